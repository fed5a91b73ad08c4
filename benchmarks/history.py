"""Run suite entries, append their numbers to ``history.jsonl``, and render ``RESULTS.md`` from it.

One JSON object per line: ``date`` (UTC, ISO), ``commit`` (short hash, ``+dirty`` when the tree had
changes), ``hardware`` (GPU name or CPU), ``command``, ``entry``, ``seconds``, ``numbers`` (what the
entry returned) and, for a GPU entry where NVML answers, ``telemetry``: the GPU's busy SM clock, power and
clock-limit reasons while it ran (:mod:`benchmarks.telemetry`; RESULTS.md shows them beside the hardware).
Smoke runs are not recorded. ``RESULTS.md`` shows, per goal of the suite, the latest record of its entry and the spread (lowest .. highest) of the goal's number over the last three records of
that entry that hold it on the same hardware: a speed claim holds when it holds on a re-run.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.suite import ENTRIES, Entry

__all__ = ["HISTORY", "RESULTS", "check_numbers", "merge", "read_history", "render_results", "run_entries", "run_sampled"]

ROOT = Path(__file__).resolve().parent
HISTORY = ROOT / "history.jsonl"
RESULTS = ROOT / "RESULTS.md"


def hardware() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()}"


def commit() -> str:
    """The checkout's short hash (``+dirty``); ``LUMENRL_COMMIT`` overrides it: a GPU machine runs a copy
    of the tree whose git state is not ours (``benchmarks/gpu_env.sh`` reads the shipped ``.whl/COMMIT``)."""
    if os.environ.get("LUMENRL_COMMIT"):
        return os.environ["LUMENRL_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def check_numbers(entry: Entry, numbers: dict[str, Any]) -> list[str]:
    """Problems with an entry's result: declared numbers missing or not finite, values not flat."""
    problems = [f"{k}: missing" for k in entry.numbers if k not in numbers]
    problems += [f"{k}={numbers[k]!r}: not a finite number" for k in entry.numbers
                 if k in numbers and not (isinstance(numbers[k], (int, float)) and math.isfinite(numbers[k]))]
    problems += [f"{k}: {type(v).__name__} is not a number or short string" for k, v in numbers.items()
                 if not isinstance(v, (int, float, str, bool)) or (isinstance(v, str) and len(v) > 200)]
    return problems


def expected_seconds(entry: Entry, history: list[dict[str, Any]] | None = None) -> float | None:
    """How long a full run of ``entry`` takes: the median ``seconds`` of its last 3 records on this kind of
    hardware (a GPU's for a CUDA entry, a CPU's otherwise); None when it has none."""
    on_gpu = entry.device == "cuda"
    seconds = [r["seconds"] for r in (read_history() if history is None else history)
               if r.get("entry") == entry.name and isinstance(r.get("seconds"), (int, float))
               and (not str(r.get("hardware", "")).startswith("CPU")) == on_gpu][-3:]
    return sorted(seconds)[len(seconds) // 2] if seconds else None


def over_budget(entry: Entry, budget_s: float | None, elapsed_s: float,
                history: list[dict[str, Any]] | None = None) -> str | None:
    """Why ``entry`` should not start with ``elapsed_s`` of ``budget_s`` spent (its expected time does not fit
    in what is left), or None. A machine lent for a fixed time kills an entry that overruns it, and an entry
    killed midway records nothing: better skipped and said so. An entry with no record starts."""
    if budget_s is None:
        return None
    expected = expected_seconds(entry, history)
    left = budget_s - elapsed_s
    if expected is not None and expected > left:
        return f"skipped: takes about {expected:.0f} s, {max(left, 0):.0f} s of --budget-s {budget_s:g} left"
    return None


def run_entries(chosen: list[Entry], *, smoke: bool, command: str, record: bool = True,
                budget_s: float | None = None) -> int:
    """Run each entry; print a table; append full runs to the history. Return the number that failed.
    ``budget_s``: the seconds this call may take; a full run skips an entry that would not fit in what is left
    (:func:`over_budget`).

    A full run runs each entry in a fresh interpreter (:func:`run_isolated`), so its figures do not depend on
    which entries ran before it in the same job: a previous entry's cached GPU memory, worker pools, threads
    and environment changes stay in its own process. (Seen on an H200: the async entry's rollouter took
    2.4-3.6 s to its first group after the train entry in one process, 0.8 s in a process of its own.)
    Smoke runs stay in this process (seconds each; the tests run them)."""
    import torch

    rows, failed, start = [], 0, time.perf_counter()
    records = read_history() if budget_s is not None and not smoke else None  # expected times: one read
    for entry in chosen:
        if not smoke and entry.device == "cuda" and not torch.cuda.is_available():
            rows.append((entry.name, "skipped (needs CUDA)", ""))
            continue
        reason = None if smoke else over_budget(entry, budget_s, time.perf_counter() - start, records)
        if reason:
            rows.append((entry.name, reason, ""))
            continue
        t0 = time.perf_counter()
        telemetry: dict[str, float] = {}
        try:
            if smoke:
                numbers = entry.load()(smoke)
            else:
                numbers, telemetry = run_sampled(entry)
            problems = check_numbers(entry, numbers)
        except Exception:  # one broken benchmark must not hide the others' numbers
            traceback.print_exc()
            numbers, problems = {}, ["raised (traceback above)"]
        seconds = time.perf_counter() - t0
        failed += bool(problems)
        status = "FAILED: " + "; ".join(problems) if problems else f"ok {seconds:.1f}s"
        rows.append((entry.name, status, _headline(entry, numbers)))
        if record and not smoke and not problems:
            append(entry, numbers, command=command, seconds=seconds, telemetry=telemetry)
    _print_table(rows)
    return failed


_ISOLATED = """
import json, sys
from benchmarks.suite import Entry
numbers = Entry(name=sys.argv[1], target=sys.argv[2], suites=()).load()(False)
with open(sys.argv[3], "w") as f:
    json.dump(numbers, f)
"""


def run_isolated(entry: Entry) -> dict[str, Any]:
    """``entry``'s full run in a fresh interpreter (this one's ``sys.path`` and environment; output shown
    as it comes); its numbers, or RuntimeError when it fails."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "numbers.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = subprocess.run([sys.executable, "-c", _ISOLATED, entry.name, entry.target, str(out)],
                              cwd=ROOT.parent, env=env).returncode
        if code != 0 or not out.exists():
            raise RuntimeError(f"entry {entry.name} exited with status {code} (its output is above)")
        return json.loads(out.read_text())


def run_sampled(entry: Entry) -> tuple[dict[str, Any], dict[str, float]]:
    """:func:`run_isolated`, with the GPU's clocks, power and clock-limit reasons sampled from this process
    while it runs (:mod:`benchmarks.telemetry`; a CPU entry or a machine without NVML: no telemetry)."""
    from benchmarks.telemetry import GpuSampler

    if entry.device != "cuda":
        return run_isolated(entry), {}
    with GpuSampler(0.25) as sampler:
        numbers = run_isolated(entry)
    return numbers, sampler.summary()


def append(entry: Entry, numbers: dict[str, Any], *, command: str, seconds: float,
           telemetry: dict[str, float] | None = None) -> None:
    rec = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit(),
           "hardware": hardware(), "command": command, "entry": entry.name, "seconds": round(seconds, 1),
           "numbers": numbers}
    if telemetry:  # what the GPU ran at meanwhile (busy samples): clocks, power, clock-limit reasons
        rec["telemetry"] = telemetry
    line = json.dumps(rec, sort_keys=True) + "\n"
    with HISTORY.open("a") as f:
        f.write(line)
    if os.environ.get("LUMENRL_BENCH_OUT"):  # a copy beside the detail JSON (a GPU job's $OUT comes back)
        with (Path(os.environ["LUMENRL_BENCH_OUT"]) / "history_new.jsonl").open("a") as f:
            f.write(line)


def merge(path: Path) -> int:
    """Append the records of ``path`` (e.g. a GPU job's history_new.jsonl) not already in the history."""
    have = {json.dumps(r, sort_keys=True) for r in read_history()}
    new = [r for r in read_history(path) if json.dumps(r, sort_keys=True) not in have]
    with HISTORY.open("a") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in new)
    return len(new)


def _headline(entry: Entry, numbers: dict[str, Any]) -> str:
    keys = entry.numbers[:4]
    return "  ".join(f"{k}={_fmt(numbers[k])}" for k in keys if k in numbers)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    width = max([len(r[0]) for r in rows] + [5])
    print(f"\n{'entry':<{width}}  status / numbers")
    for name, status, head in rows:
        print(f"{name:<{width}}  {status}  {head}")
    sys.stdout.flush()


def read_history(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or HISTORY
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(*cells: str) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


SPREAD_RUNS = 3  # RESULTS.md's spread column: the last this many records of an entry that hold the number


def spread(history: list[dict[str, Any]], entry: str, metric: str, runs: int = SPREAD_RUNS,
           hardware: str | None = None, since: str = "") -> str:
    """``lo .. hi (n runs)`` of ``metric`` over the last ``runs`` records of ``entry`` (by date) that hold it,
    counting only records on ``hardware`` where given (an H100 figure is no re-run of an H200 one) and dated
    ``since`` or later."""
    values = [r["numbers"][metric] for r in sorted(history, key=lambda r: r["date"])
              if r["entry"] == entry and isinstance(r["numbers"].get(metric), (int, float))
              and hardware in (None, r["hardware"]) and r["date"] >= since][-runs:]
    if not values:
        return ""
    if len(values) == 1:
        return "1 run"
    return f"{_fmt(min(values))} .. {_fmt(max(values))} ({len(values)} runs)"


def _gpu_state(telemetry: dict[str, float] | None) -> str:
    """`` (SM 1755 MHz, 640 W, power-capped 35%)``: the run's busy median clock and power, and how often a
    power cap or a thermal slowdown held the clock down; "" for a run recorded without telemetry."""
    if not telemetry or "sm_mhz_median" not in telemetry:
        return ""
    parts = [f"SM {telemetry['sm_mhz_median']:.0f} MHz"]
    if "power_w_median" in telemetry:
        parts.append(f"{telemetry['power_w_median']:.0f} W")
    for key, label in (("power_capped_frac", "power-capped"), ("thermal_frac", "thermal slowdown")):
        if telemetry.get(key):
            parts.append(f"{label} {100 * telemetry[key]:.0f}%")
    return " (" + ", ".join(parts) + ")"


def render_results(history: list[dict[str, Any]]) -> str:
    """RESULTS.md: one row per goal and hardware, from the latest history record of its entry on that hardware
    (the most recently measured hardware first), with the spread of its number over that hardware's last three
    records of the entry."""
    latest: dict[str, dict[str, Any]] = {}
    by_hardware: dict[tuple[str, str], dict[str, Any]] = {}
    since = {e.name: e.since for e in ENTRIES}
    for rec in history:
        if rec["date"] >= latest.get(rec["entry"], {}).get("date", ""):
            latest[rec["entry"]] = rec
        if rec["date"] < since.get(rec["entry"], ""):  # what the entry measures changed since (Entry.since)
            continue
        if rec["date"] >= by_hardware.get((rec["entry"], rec["hardware"]), {}).get("date", ""):
            by_hardware[(rec["entry"], rec["hardware"])] = rec
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks results` from `benchmarks/history.jsonl` (do not edit by hand).",
        "Each row: the latest recorded figure of a goal's entry on one hardware (the most recently measured first),",
        f"and the spread (lowest .. highest) of that number over the entry's last {SPREAD_RUNS} records on that "
        "hardware.",
        "Run `python -m benchmarks run gpu` on a GPU to add figures; the history keeps every run (date, commit,",
        "hardware, command, numbers).",
        "",
        f"| goal | entry | target | current | met? | last {SPREAD_RUNS} runs | date | commit | hardware | command |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in ENTRIES:
        records = sorted((r for (name, _), r in by_hardware.items() if name == entry.name),
                         key=lambda r: r["date"], reverse=True)
        for goal, metric, bound in entry.goals():
            target = f"{metric} {bound}"
            if not records:
                lines.append(_row(goal, f"`{entry.name}`", target, "not measured", "", "", "", "", "", ""))
            for rec in records:
                value = rec["numbers"].get(metric)
                met = entry.met(value, bound)
                runs = spread(history, entry.name, metric, hardware=rec["hardware"], since=entry.since)
                lines.append(_row(goal, f"`{entry.name}`", target, _fmt(value),
                                  "yes" if met else "no" if met is False else "?", runs, rec["date"][:10],
                                  rec["commit"], rec["hardware"] + _gpu_state(rec.get("telemetry")),
                                  f"`{rec['command']}`"))
    changed = [e for e in ENTRIES if e.since and any(r["entry"] == e.name and r["date"] < e.since for r in history)]
    if changed:
        lines += ["", "Only records since what an entry measures last changed count above (older ones stay in the "
                  "history): " + ", ".join(f"`{e.name}` since {e.since[:16].replace('T', ' ')} UTC" for e in changed)
                  + "."]
    others = sorted({r["entry"] for r in history} - {e.name for e in ENTRIES if e.goal})
    if others:
        lines += ["", "Measurements without a goal (latest): " + ", ".join(
            f"`{n}` ({latest[n]['date'][:10]}, {latest[n]['commit']})" for n in others) + "."]
    return "\n".join(lines) + "\n"
