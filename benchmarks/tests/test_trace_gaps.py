"""trace_gaps: the GPU idle gaps of a kineto trace and the host work that covered them (synthetic traces)."""

from __future__ import annotations

import random

import torch
from benchmarks.gpu.trace_gaps import (
    _covers,
    _host_cover,
    format_gaps,
    gap_text,
    idle_gaps,
    idle_summary,
    profile_gaps,
)


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


def test_idle_summary_splits_idle_by_phase_and_host():
    trace = {"traceEvents": [
        _x("user_annotation", "lumenrl/generate", 0, 300), _x("user_annotation", "lumenrl/update", 300, 400),
        _x("user_annotation", "other/range", 0, 1000),  # not a phase: ignored
        _x("kernel", "a", 0, 100), _x("kernel", "b", 50, 100),  # busy 0..150
        _x("cpu_op", "aten::item", 150, 60),  # 60 us idle in generate, covered by the host's item()
        _x("kernel", "c", 210, 40),  # busy 210..250
        _x("kernel", "d", 252, 10),  # a 2 us gap: below min_us, counts in idle_ms only
        _x("kernel", "e", 400, 100),  # 138 us idle from 262: starts inside generate
        _x("kernel", "f", 800, 10),  # 300 us idle from 500: inside update, no host work covering it
    ]}
    out = idle_summary(trace, min_us=5.0)
    assert out["span_ms"] == 0.81 and out["busy_ms"] == 0.31 and out["idle_ms"] == 0.5
    assert out["gaps"] == 3
    assert out["idle_ms_by_phase"] == {"generate": 0.198, "update": 0.3}
    assert [g["gap_us"] for g in out["largest_gaps"]] == [300.0, 138.0, 60.0]
    assert out["largest_gaps"][0]["phase"] == "update" and out["largest_gaps"][0]["after"] == "f"
    assert out["largest_gaps"][2] == {"gap_us": 60.0, "phase": "generate", "after": "c", "host": "aten::item",
                                      "host_path": "other/range > lumenrl/generate > aten::item"}  # outermost first
    assert out["largest_gaps"][0]["host_path"] == "other/range > lumenrl/update"  # no host op: the ranges alone
    # busy time by phase: no launch recorded here, so each activity's share of the union goes to the phase at its start
    assert out["busy_ms_by_phase"] == {"": 0.01, "generate": 0.2, "update": 0.1}
    assert out["idle_ms_by_host"] == {"update: -": 0.3, "generate: -": 0.138, "generate: aten::item": 0.06}
    assert len(idle_summary(trace, top=1)["largest_gaps"]) == 1
    assert idle_summary({"traceEvents": []})["idle_ms"] == 0.0


def test_busy_time_goes_to_the_phase_that_launched_it():
    """A kernel runs after its launching phase ended (queued work): its time counts for the launching phase; a
    nested range (the engine's prefill inside generate) takes its own launches."""
    trace = {"traceEvents": [
        _x("user_annotation", "lumenrl/generate", 0, 100), _x("user_annotation", "lumenrl/prefill", 10, 20),
        _x("user_annotation", "lumenrl/update", 100, 200),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=1), _x("kernel", "prefill_gemm", 15, 30, corr=1),
        _x("cuda_runtime", "cudaGraphLaunch", 50, 2, corr=2), _x("kernel", "decode_step", 60, 80, corr=2),  # to 140
        _x("cuda_runtime", "cudaLaunchKernel", 150, 2, corr=3), _x("kernel", "backward", 155, 40, corr=3),
    ]}
    out = idle_summary(trace, min_us=5.0)
    assert out["busy_ms_by_phase"] == {"prefill": 0.03, "generate": 0.08, "update": 0.04}
    assert out["busy_ms"] == 0.15


def test_phase_timer_marks_each_phase_in_a_profiler_trace():
    from benchmarks.gpu.trace_gaps import export_trace
    from torch.profiler import ProfilerActivity, profile

    from lumenrl_backends.trainers.metrics import PhaseTimer

    timer = PhaseTimer()
    with profile(activities=[ProfilerActivity.CPU]) as prof, timer("generate"):
        torch.randn(32, 32) @ torch.randn(32, 32)
    names = {e.get("name") for e in export_trace(prof)["traceEvents"] if e.get("cat") == "user_annotation"}
    assert "lumenrl/generate" in names and timer.seconds["generate"] > 0


def test_host_path_names_the_python_frames_of_a_stack_trace():
    """With ``with_stack`` the trace holds Python frames: the gap's path runs through them, innermost last,
    each frame shortened to its file and function; a deep path keeps its innermost frames."""
    frames = [_x("python_function", f"pkg/mod{i}.py({i}): f{i}", 0 + i, 1000 - 2 * i) for i in range(12)]
    trace = {"traceEvents": [
        _x("user_annotation", "lumenrl/generate", 0, 1000), *frames,
        _x("kernel", "a", 0, 100), _x("kernel", "b", 400, 10),  # 300 us idle inside every frame
    ]}
    gap = idle_summary(trace)["largest_gaps"][0]
    assert gap["gap_us"] == 300.0
    assert gap["host_path"] == "... > " + " > ".join(f"mod{i}.py({i}): f{i}" for i in range(2, 12))


def test_idle_by_host_adds_up_many_short_gaps():
    """Forty 10 us gaps under one host operation outweigh one 200 us gap: the sum by operation shows it."""
    events = [_x("user_annotation", "lumenrl/update_actor", 0, 2000), _x("cpu_op", "aten::mul", 0, 1000)]
    events += [_x("kernel", f"k{i}", 20 * i, 10) for i in range(41)]  # 10 us idle after each
    events += [_x("cpu_op", "aten::item", 810, 200), _x("kernel", "late", 1010, 5)]  # 200 us inside item()
    out = idle_summary({"traceEvents": events}, min_us=5.0, top=2)
    assert out["idle_ms_by_host"] == {"update_actor: aten::mul": 0.4, "update_actor: aten::item": 0.2}
    assert out["largest_gaps"][0]["gap_us"] == 200.0


def test_the_sweep_names_the_same_host_operation_as_a_full_scan():
    rng = random.Random(0)
    host = [_x("cpu_op", f"op{i}", rng.uniform(0, 10_000), rng.choice([5, 50, 500, 5000])) for i in range(400)]
    gaps = sorted(((rng.uniform(0, 10_000), rng.uniform(5, 300), {}, "") for _ in range(300)), key=lambda g: g[0])
    assert _covers(host, gaps) == [_host_cover(host, start, start + length) for start, length, _, _ in gaps]


def test_gap_text_fits_a_history_string_and_keeps_the_innermost_frames():
    frames = [f"module_{i}.py({i * 10}): function_{i}" for i in range(12)]
    gap = {"gap_us": 20870.0, "phase": "generate", "after": "Memcpy HtoD (Pageable -> Device)", "host": "aten::index",
           "host_path": " > ".join(["...", *frames])}
    text = gap_text(gap)
    assert len(text) <= 200 and text.startswith("20.87 ms in generate before Memcpy HtoD")
    kept = text.split("path: ... > ")[1].removesuffix(")").split(" > ")
    assert 1 <= len(kept) < len(frames) and kept == frames[-len(kept):]  # the innermost frames, in order
    short = {**gap, "phase": "", "host": "", "host_path": "lumenrl/update > aten::mul"}
    assert gap_text(short) == ("20.87 ms in no phase before Memcpy HtoD (Pageable -> Device) (host: -; "
                               "path: lumenrl/update > aten::mul)")
