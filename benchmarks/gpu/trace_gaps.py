"""Where a profiled GPU timeline idles, and what the host was doing then.

``idle_gaps(trace)`` reads a kineto chrome trace (``torch.profiler.profile(...).export_chrome_trace``), finds
the largest gaps between GPU activities (kernels, memcpy, memset: the union of their intervals, all streams),
and for each names the activity after it, how late the host launched that activity (its runtime call's start
minus the gap's start: > 0 means the GPU waited for the host), and the host operation that covered most of
the gap (the innermost ``cpu_op`` or runtime call, e.g. ``aten::_chunk_cat`` or ``cudaStreamSynchronize``).
A gap whose activity was launched before it began waited on something else (another stream, an event).
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


def _host_cover(host: list[dict[str, Any]], start: float, end: float) -> str:
    """The innermost (shortest) host event covering at least half of [start, end); else the one covering most
    of it; '' if none overlaps."""
    overlaps = [(min(end, e["ts"] + e["dur"]) - max(start, e["ts"]), e) for e in host]
    overlaps = [(o, e) for o, e in overlaps if o > 0]
    if not overlaps:
        return ""
    half = [e for o, e in overlaps if o >= 0.5 * (end - start)]
    if half:
        return min(half, key=lambda e: e["dur"])["name"]
    return max(overlaps, key=lambda oe: oe[0])[1]["name"]


def idle_gaps(trace: dict[str, Any], top: int = 5, min_us: float = 20.0) -> list[dict[str, Any]]:
    """The ``top`` largest GPU idle gaps of at least ``min_us`` microseconds, largest first."""
    gpu = sorted(_events(trace, GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in _events(trace, ("cuda_runtime", "cuda_driver"))
                if e.get("args", {}).get("correlation") is not None}
    host = _events(trace, HOST_CATS)
    gaps: list[dict[str, Any]] = []
    end, before = None, ""
    for e in gpu:
        if end is not None and e["ts"] - end >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))  # no None key: uncorrelated -> None
            late = launch["ts"] - end if launch is not None else None
            gaps.append({
                "gap_us": round(e["ts"] - end, 1), "before": before[:60], "after": e["name"][:60],
                "launch_late_us": round(late, 1) if late is not None else None,
                "host": _host_cover(host, end, e["ts"])[:60],
            })
        if end is None or e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e["name"]
    return sorted(gaps, key=lambda g: -g["gap_us"])[:top]


def profile_gaps(prof: Any, top: int = 5) -> list[dict[str, Any]]:
    """:func:`idle_gaps` of a finished ``torch.profiler.profile`` (exported to a temporary chrome trace)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return idle_gaps(json.load(f), top=top)
    finally:
        os.unlink(path)


def format_gaps(gaps: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"  gap {g['gap_us']:8.1f} us before {g['after']!r} (after {g['before']!r}); launched "
        f"{'?' if g['launch_late_us'] is None else g['launch_late_us']} us after the gap began; host: {g['host']!r}"
        for g in gaps
    )
