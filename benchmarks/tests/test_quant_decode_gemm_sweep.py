"""The FP8 rowwise decode GEMM's wide sweep (``bench_decode_gemm.py --tune --space wide``): every configuration is
one the kernel takes at the engine's decode shapes and fits the shared-memory budget."""

from __future__ import annotations

from benchmarks.quant import bench_decode_gemm as bench

from lumenrl_quant import triton_gemm as tg


def test_wide_sweep_configurations_fit_and_go_past_the_default_space():
    wide = bench._sweep_wide()
    assert wide[0] == tg.DEFAULT_CONFIG and len(wide) == len({tuple(sorted(c.items())) for c in wide})
    for cfg in wide[1:]:
        assert cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"] <= bench.SMEM_BUDGET, cfg
        for name in ("qkv", "o", "gate_up", "down"):
            n, k = bench.SHAPES[name]
            assert tg.supports(k, cfg) and n % cfg["block_n"] == 0, (name, cfg)
    default = {tuple(sorted(c.items())) for c in bench._sweep()}
    new = [c for c in wide if tuple(sorted(c.items())) not in default]
    assert any(c["block_k"] == 512 for c in new) and any(c["num_warps"] == 8 for c in new)
    assert any(c["num_stages"] >= 6 for c in new)
