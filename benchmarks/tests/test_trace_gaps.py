"""trace_gaps: the GPU idle gaps of a kineto trace and the host work that covered them (synthetic traces)."""

from __future__ import annotations

import torch
from benchmarks.gpu.trace_gaps import format_gaps, idle_gaps, profile_gaps


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_gaps_are_ranked_and_attributed_to_the_host():
    trace = {"traceEvents": [
        _x("kernel", "gemm_a", 0, 100, corr=1), _x("cuda_runtime", "cudaLaunchKernel", -5, 2, corr=1),
        _x("kernel", "overlapping", 50, 70, corr=2),  # ends at 120: the union, not the last kernel, counts
        # 380 us idle after 120: the host was inside chunk_cat (inside post_backward), launched late by 370
        _x("cpu_op", "FSDP::post_backward", 100, 400), _x("cpu_op", "aten::_chunk_cat", 110, 370),
        _x("cuda_runtime", "cudaLaunchKernel", 490, 3, corr=3), _x("kernel", "chunk_cat_kernel", 500, 50, corr=3),
        # 50 us idle after 550, launched before it began: a wait on something else
        _x("cuda_runtime", "cudaLaunchKernel", 540, 3, corr=4), _x("gpu_memcpy", "Memcpy DtoD", 600, 10, corr=4),
        _x("kernel", "tiny_gap", 615, 5),  # 5 us: below min_us
        _x("cpu_op", "aten::item", 620, 30), _x("cuda_runtime", "cudaStreamSynchronize", 622, 27),
        _x("kernel", "after_sync", 660, 5),  # 40 us idle: the host was in a stream sync
        {"ph": "i", "name": "marker", "ts": 0},  # not a complete event: ignored
    ]}
    gaps = idle_gaps(trace, top=5, min_us=20)
    assert [g["gap_us"] for g in gaps] == [380.0, 50.0, 40.0]
    first, second, third = gaps
    assert first["after"] == "chunk_cat_kernel" and first["before"] == "overlapping"
    assert first["host"] == "aten::_chunk_cat" and first["launch_late_us"] == 370.0
    assert second["after"] == "Memcpy DtoD" and second["launch_late_us"] == -10.0
    assert third["host"] == "cudaStreamSynchronize" and third["launch_late_us"] is None
    assert idle_gaps(trace, top=1)[0]["gap_us"] == 380.0
    assert "chunk_cat_kernel" in format_gaps(gaps)
    assert idle_gaps({"traceEvents": []}) == []


def test_profile_gaps_reads_a_real_profiler_trace():
    """On the CPU the trace has no GPU activity: no gaps, and the export round trip works."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert profile_gaps(prof) == []
