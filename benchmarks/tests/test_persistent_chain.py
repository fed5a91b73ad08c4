"""The persistent GEMM-chain prototype (``benchmarks/gpu/persistent_chain.py``) computes the per-GEMM chain's bits."""

from __future__ import annotations

from benchmarks.quant._common import run_interpreted


def test_the_persistent_chain_equals_the_per_gemm_chain_in_the_interpreter():
    result = run_interpreted("benchmarks.gpu.persistent_chain:interpreted_check")
    assert result["equal"], result  # the same tiles and K order as the decode kernel: the same bits
    assert result["dataflow_equal"], result  # K in segments: the same steps in the same order
    assert max(k // s for k, s in zip((64, 64, 64, 256), result["segments"])) > 1  # some GEMM walked K in segments
