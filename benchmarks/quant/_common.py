"""Shared helpers for the lumenrl-quant benchmarks: timing, environment, tables, JSON output."""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def environment() -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, sm=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   cuda=torch.version.cuda, memory_gib=round(props.total_memory / 2**30, 1))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], *, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds per call (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    if torch.cuda.is_available():
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def time_rotating_ms(fns: list[Callable[[], object]], *, warmup: int = 3, iters: int = 30) -> float:
    """Median ms of one call when cycling over ``fns`` (distinct operands: working set beyond L2)."""
    for f in fns[:warmup]:
        f()
    sync()
    n = len(fns)
    per_round = []
    rounds = max(1, iters // n)
    for _ in range(max(3, rounds)):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for f in fns:
                f()
            end.record()
            end.synchronize()
            per_round.append(start.elapsed_time(end) / n)
        else:
            t0 = time.perf_counter()
            for f in fns:
                f()
            per_round.append((time.perf_counter() - t0) * 1e3 / n)
    per_round.sort()
    return per_round[len(per_round) // 2]


def time_graph_ms(fns: list[Callable[[], object]], *, iters: int = 20) -> tuple[float, str]:
    """Median ms per call of ``fns`` captured in one CUDA graph and replayed ``iters`` times (no
    launch/host overhead, as in a CUDA-graph decode step). Falls back to :func:`time_rotating_ms` when
    capture fails; on the CPU (smoke runs) that with ``iters`` calls."""
    if not torch.cuda.is_available():
        return time_rotating_ms(fns, iters=iters), "eager"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (Triton compiles, cuBLAS workspaces) off the capture
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
    except Exception:  # capture not possible for this path: report eager timing instead
        torch.cuda.synchronize()
        return time_rotating_ms(fns), "eager(capture failed)"
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    times.sort()
    del graph
    return times[len(times) // 2], "cuda_graph"


def run_interpreted(target: str) -> dict:
    """``target()`` (``"module:function"``, no arguments, returning a JSON-able dict) under Triton's
    CPU interpreter, for the smoke runs of Triton kernels on a machine without a GPU: in this process
    when ``TRITON_INTERPRET=1`` is set already, else in a fresh one (Triton reads the variable when it
    decorates a kernel, so a process that imported the kernels cannot switch). The child's stdout is
    passed through; its dict comes back as JSON; its failure raises with the end of its stderr."""
    module, _, func = target.partition(":")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return getattr(importlib.import_module(module), func)()
    root = Path(__file__).resolve().parents[2]  # the checkout: ``benchmarks`` importable as a package
    code = (f"import json, pathlib, sys\nfrom {module} import {func}\n"
            f"pathlib.Path(sys.argv[1]).write_text(json.dumps({func}(), default=str))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        done = subprocess.run([sys.executable, "-c", code, str(result)], env=env, cwd=root, capture_output=True,
                              text=True, timeout=600)
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            raise RuntimeError(f"{target} under TRITON_INTERPRET=1 failed:\n{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def copies_for(bytes_per_copy: int, working_set: int = 256 * 2**20, cap: int = 64) -> int:
    """How many operand copies make the working set exceed the L2 (60 MB on H200) several times."""
    return max(1, min(cap, math.ceil(working_set / max(1, bytes_per_copy))))


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double().cpu(), approx.double().cpu()
    err = (ref - approx).norm().item()
    return float("inf") if err == 0 else 20 * math.log10(ref.norm().item() / err)


def table(title: str, rows: list[dict], cols: list[str]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = [f"### {title}", "", "| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |",
             "| " + " | ".join("-" * widths[c] for c in cols) + " |"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_json(name: str, payload: dict) -> Path:
    """Write ``$LUMENRL_BENCH_OUT/<name>.json`` (default ``benchmarks/results/``, git-ignored; on the GPU machine
    ``benchmarks/gpu_env.sh`` points ``LUMENRL_BENCH_OUT`` at the device tool's ``$OUT``)."""
    payload = {"environment": environment(), **payload}
    path = Path(os.environ.get("LUMENRL_BENCH_OUT") or RESULTS_DIR) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path
