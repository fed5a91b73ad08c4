"""The fused-MoE kernel micro-benchmark (not a suite entry: run by hand on the GPU) runs in its CPU smoke
size and its three variants agree with the float64 reference."""

from __future__ import annotations

from benchmarks.moe.fused_moe_kernel import moe_kernel_bench


def test_kernel_bench_smoke_runs_and_every_variant_is_accurate():
    out = moe_kernel_bench(smoke=True, n=5)
    for name in ("grouped_mm", "fused_bf16", "fused_fp8"):
        assert out[f"{name}_us"] > 0 and out[f"{name}_rel_err"] < 1e-5, (name, out)
