"""Where a profiled GPU timeline idles, and what the host was doing then.

``idle_gaps(trace)`` reads a kineto chrome trace (``torch.profiler.profile(...).export_chrome_trace``), finds
the largest gaps between GPU activities (kernels, memcpy, memset: the union of their intervals, all streams),
and for each names the activity after it, how late the host launched that activity (its runtime call's start
minus the gap's start: > 0 means the GPU waited for the host), and the host operation that covered most of
the gap (the innermost ``cpu_op`` or runtime call, e.g. ``aten::_chunk_cat`` or ``cudaStreamSynchronize``).
A gap whose activity was launched before it began waited on something else (another stream, an event).

``idle_summary(trace)`` totals a whole trace instead: span, busy time (the union of GPU activities) and idle time,
the idle split by the ``lumenrl/<phase>`` range around it (the trainer's ``PhaseTimer`` marks each phase of a step,
the rollout its ``prompts``/``generate``/``score`` and the native engine its ``prefill``), the busy time split by the
phase that launched each activity, and the largest gaps with the host work that covered them: which phase of a
profiled step keeps the GPU busy, and which leaves it waiting.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")


def _events(trace: dict[str, Any], cats: tuple[str, ...]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats
            and "ts" in e and "dur" in e]


def _launches(trace: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """Runtime/driver calls by correlation id (the launch of the GPU activity with the same id)."""
    return {e["args"]["correlation"]: e for e in _events(trace, ("cuda_runtime", "cuda_driver"))
            if e.get("args", {}).get("correlation") is not None}


def _overlap(e: dict[str, Any], start: float, end: float) -> float:
    """Microseconds of [start, end) that event ``e`` covers (<= 0: none)."""
    return min(end, e["ts"] + e["dur"]) - max(start, e["ts"])


def _host_cover(host: list[dict[str, Any]], start: float, end: float) -> str:
    """The innermost (shortest) host event covering at least half of [start, end); else the one covering most
    of it; '' if none overlaps."""
    overlaps = [(_overlap(e, start, end), e) for e in host]
    overlaps = [(o, e) for o, e in overlaps if o > 0]
    if not overlaps:
        return ""
    half = [e for o, e in overlaps if o >= 0.5 * (end - start)]
    if half:  # ties: the earliest start (the same answer whatever the order of ``host``)
        return min(half, key=lambda e: (e["dur"], e["ts"]))["name"]
    return max(overlaps, key=lambda oe: (oe[0], -oe[1]["ts"]))[1]["name"]


def _host_path(host: list[dict[str, Any]], start: float, end: float, depth: int = 10) -> str:
    """The host events (phase ranges, and Python frames of a ``with_stack`` trace, included) covering at least half
    of [start, end), outermost first, the innermost ``depth`` of them: the call path the gap sat in, e.g.
    ``lumenrl/generate > aten::repeat_interleave``. A frame shows as ``file.py(line): function``."""
    covering = sorted((e for e in host if _overlap(e, start, end) >= 0.5 * (end - start)),
                      key=lambda e: (-e["dur"], e["ts"]))
    names = [e["name"].rsplit("/", 1)[-1] if e.get("cat") == "python_function" else e["name"] for e in covering]
    return " > ".join((["..."] if len(names) > depth else []) + names[-depth:])


def _walk(gpu: list[dict[str, Any]], min_us: float) -> tuple[
        list[tuple[dict[str, Any], float]], list[tuple[float, float, dict[str, Any], str]]]:
    """Each activity's share of the union of the intervals (``gpu`` sorted by start; their sum is the busy time)
    and the idle gaps of at least ``min_us``: (start, length, the activity after it, the name of the one whose end
    began it)."""
    shares: list[tuple[dict[str, Any], float]] = []
    end, before = None, ""
    gaps: list[tuple[float, float, dict[str, Any], str]] = []
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is not None and start - end >= min_us:
            gaps.append((end, start - end, e, before))
        if end is None or stop > end:
            shares.append((e, stop - max(start, end if end is not None else start)))
            end, before = stop, e["name"]
    return shares, gaps


def _covers(host: list[dict[str, Any]], gaps: list[tuple[float, float, dict[str, Any], str]]) -> list[str]:
    """:func:`_host_cover` of every gap (``gaps`` in start order, as :func:`_walk` gives them) in one sweep: host
    events sorted by start, those that ended before a gap began dropped for good, as later gaps start later."""
    host = sorted(host, key=lambda e: e["ts"])
    out, live, i = [], [], 0
    for start, length, _, _ in gaps:
        while i < len(host) and host[i]["ts"] < start + length:
            live.append(host[i])
            i += 1
        live = [e for e in live if e["ts"] + e["dur"] > start]
        out.append(_host_cover(live, start, start + length))
    return out


def _by_host(gaps: list[tuple[float, float, dict[str, Any], str]], covers: list[str], phase_at: Any,
             top: int) -> dict[str, float]:
    """Idle milliseconds summed by (phase, the host operation that covered the gap), the ``top`` largest."""
    total: dict[str, float] = {}
    for (start, length, _, _), name in zip(gaps, covers, strict=True):
        key = f"{phase_at(start) or 'no phase'}: {name[:60] or '-'}"
        total[key] = total.get(key, 0.0) + length
    return {k: round(v / 1e3, 3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


def _largest(gaps: list[tuple[float, float, dict[str, Any], str]], top: int) -> list[tuple[float, float, dict[str, Any], str]]:
    return sorted(gaps, key=lambda g: -g[1])[:top]


def idle_gaps(trace: dict[str, Any], top: int = 5, min_us: float = 20.0) -> list[dict[str, Any]]:
    """The ``top`` largest GPU idle gaps of at least ``min_us`` microseconds, largest first."""
    gpu = sorted(_events(trace, GPU_CATS), key=lambda e: e["ts"])
    launches = _launches(trace)
    host = _events(trace, HOST_CATS)
    out: list[dict[str, Any]] = []
    for start, length, e, before in _largest(_walk(gpu, min_us)[1], top):
        launch = launches.get(e.get("args", {}).get("correlation"))  # no None key: uncorrelated -> None
        out.append({"gap_us": round(length, 1), "before": before[:60], "after": e["name"][:60],
                    "launch_late_us": round(launch["ts"] - start, 1) if launch is not None else None,
                    "host": _host_cover(host, start, start + length)[:60]})
    return out


def idle_summary(trace: dict[str, Any], *, min_us: float = 5.0, top: int = 5,
                 phase_prefix: str = "lumenrl/") -> dict[str, Any]:
    """Span, busy and idle milliseconds of the trace's GPU activities (busy: the union of their intervals); the
    idle gaps of at least ``min_us`` summed by the phase range (a ``user_annotation`` named ``phase_prefix...``)
    that holds the gap's start (``""``: none), the idle summed by phase and covering host operation (``idle_ms_by_host``,
    the ``top`` largest: many short gaps under one operation add up), and the ``top`` largest gaps with their phase and
    the host work that covered them (as in :func:`idle_gaps`). Gaps below ``min_us`` count in ``idle_ms`` only."""
    gpu = sorted(_events(trace, GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "idle_ms_by_phase": {}, "busy_ms_by_phase": {},
                "idle_ms_by_host": {}, "largest_gaps": []}
    phases = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][len(phase_prefix):])
                     for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith(phase_prefix) and "ts" in e and "dur" in e),
                    key=lambda p: p[1] - p[0])  # innermost first

    def phase_at(t: float) -> str:
        return next((name for lo, hi, name in phases if lo <= t < hi), "")

    shares, gaps = _walk(gpu, min_us)
    busy = sum(added for _, added in shares)
    launches = _launches(trace)
    busy_by_phase: dict[str, float] = {}
    for e, added in shares:  # to the phase its launch (else its start) falls in
        if added <= 0:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        phase = phase_at(launch["ts"] if launch is not None else e["ts"])
        busy_by_phase[phase] = busy_by_phase.get(phase, 0.0) + added
    by_phase: dict[str, float] = {}
    for start, length, _, _ in gaps:
        phase = phase_at(start)
        by_phase[phase] = by_phase.get(phase, 0.0) + length
    host = _events(trace, HOST_CATS)
    ranges = host + _events(trace, ("user_annotation", "python_function"))
    largest = [{"gap_us": round(length, 1), "phase": phase_at(start), "after": e["name"][:60],
                "host": _host_cover(host, start, start + length)[:60],
                "host_path": _host_path(ranges, start, start + length)[:400]}
               for start, length, e, _ in _largest(gaps, top)]
    span = max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]
    by_host = _by_host(gaps, _covers(host, gaps), phase_at, top)
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3), "idle_ms": round((span - busy) / 1e3, 3),
            "gaps": len(gaps), "idle_ms_by_phase": {k: round(v / 1e3, 3) for k, v in sorted(by_phase.items())},
            "busy_ms_by_phase": {k: round(v / 1e3, 3) for k, v in sorted(busy_by_phase.items())},
            "idle_ms_by_host": by_host, "largest_gaps": largest}


def export_trace(prof: Any) -> dict[str, Any]:
    """A finished ``torch.profiler.profile`` as a chrome-trace dict (through a temporary file)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def profile_gaps(prof: Any, top: int = 5) -> list[dict[str, Any]]:
    """:func:`idle_gaps` of a finished ``torch.profiler.profile`` (exported to a temporary chrome trace)."""
    return idle_gaps(export_trace(prof), top=top)


def format_gaps(gaps: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"  gap {g['gap_us']:8.1f} us before {g['after']!r} (after {g['before']!r}); launched "
        f"{'?' if g['launch_late_us'] is None else g['launch_late_us']} us after the gap began; host: {g['host']!r}"
        for g in gaps
    )


def gap_text(gap: dict[str, Any], limit: int = 200) -> str:
    """One of :func:`idle_summary`'s largest gaps as a line of at most ``limit`` characters (a history number is a
    short string): its length, phase, the activity after it, the covering host operation and as many of the
    innermost frames of its host path as fit (the outer ones become ``...``)."""
    head = (f"{gap['gap_us'] / 1e3:.2f} ms in {gap['phase'] or 'no phase'} before {gap['after']} "
            f"(host: {gap['host'] or '-'}; path: ")
    frames = (gap.get("host_path") or "-").split(" > ")
    cut = frames[0] == "..."  # idle_summary kept only the innermost frames already
    frames = frames[1:] if cut else frames
    room = limit - len(head) - 1  # the closing parenthesis
    kept: list[str] = []
    for frame in reversed(frames):
        if len(" > ".join(["...", frame, *kept])) > room:
            break
        kept.insert(0, frame)
    if cut or len(kept) < len(frames):
        kept.insert(0, "...")
    return (head + " > ".join(kept) + ")")[:limit]
