"""The fused-MoE kernel micro-benchmark (not a suite entry: run by hand on the GPU) runs in its CPU smoke
size and its three variants agree with the float64 reference; ``decode_speed --record-cost`` runs its variants."""

from __future__ import annotations

import pytest
from benchmarks.moe.decode_speed import record_cost_variants
from benchmarks.moe.fused_moe_kernel import moe_kernel_bench


def test_kernel_bench_smoke_runs_and_every_variant_is_accurate():
    out = moe_kernel_bench(smoke=True, n=5)
    for name in ("grouped_mm", "fused_bf16", "fused_fp8"):
        assert out[f"{name}_us"] > 0 and out[f"{name}_rel_err"] < 1e-5, (name, out)


def test_record_cost_variants_run_each_kernel_option_set():
    """``decode_speed --record-cost``: one recording-cost measurement per KernelOptions variant (CPU smoke shape),
    each with its three rounds; a bad variant names the option."""
    out = record_cost_variants("pdl=off;pdl=on", smoke=True)
    assert list(out) == ["pdl=off", "pdl=on"]
    for row in out.values():
        assert row["native_decode_tok_s"] > 0 and len(row["record_overhead_rounds"].split(", ")) == 3
        assert row["plain_call_spread_pct"] >= 0 and row["recording_call_spread_pct"] >= 0
    with pytest.raises(SystemExit, match="nope=1"):
        record_cost_variants("nope=1", smoke=True)
