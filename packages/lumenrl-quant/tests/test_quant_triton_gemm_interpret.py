"""The rowwise FP8 decode GEMM (``lumenrl_quant.triton_gemm``) under Triton's CPU interpreter.

Every launch shape the benchmark sweeps (tile sizes, split-K with the torch epilogue, a fused
epilogue) against a float64 product of the same FP8 codes and scales, on fresh random data with
M not a multiple of the tile; bad configurations raise naming the key and value.
Subprocess: ``TRITON_INTERPRET`` must be set before the kernels are decorated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from lumenrl_quant import triton_gemm as tg
    from lumenrl_quant.fp8 import quantize_fp8

    torch.manual_seed(0)
    worst = 0.0
    for m, n, k in ((5, 96, 256), (20, 64, 512)):
        x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
        a_q, a_s = quantize_fp8(x, granularity="rowwise", backend="torch")
        b_q, b_s = quantize_fp8(w, granularity="rowwise", backend="torch")
        ref = (a_q.double() * a_s.double().reshape(-1, 1)) @ (b_q.double() * b_s.double().reshape(-1, 1)).T
        bias = torch.randn(n)
        for cfg in ({"block_m": 16, "block_n": 32, "block_k": 64, "split_k": 1},
                    {"block_m": 16, "block_n": 64, "block_k": 64, "split_k": 2},
                    {"block_m": 32, "block_n": 32, "block_k": 128, "split_k": 2}):
            for out_dtype in (torch.float32, torch.bfloat16):
                out = tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, out_dtype=out_dtype, bias=bias, config=cfg)
                assert out.dtype == out_dtype and out.shape == (m, n), (out.dtype, out.shape)
                err = float((out.double() - bias.double() - ref).norm() / ref.norm())
                bound = 1e-6 if out_dtype == torch.float32 else 8e-3
                assert err < bound, (m, n, k, cfg, out_dtype, err)
                worst = max(worst, err if out_dtype == torch.float32 else 0.0)
                # tma: 1 copies the same tiles through tensor descriptors (rows past M or N read as zeros): same bits
                assert tg.tma_reason(a_q, b_q) is None
                tma = tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, out_dtype=out_dtype, bias=bias, config={**cfg, "tma": 1})
                assert torch.equal(tma, out), (m, n, k, cfg, out_dtype)
        if cfg["split_k"] == 1:  # ... and through the PDL op, which passes it on
            plain = tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, config=cfg)
            assert torch.equal(tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, config={**cfg, "tma": 1}, pdl=True), plain)
    # W8A16: bf16 activations against the same FP8 weight, bf16 and fp16 dots, fused and split-K epilogue
    xb = x.bfloat16()
    ref16 = xb.double() @ (b_q.double() * b_s.double().reshape(-1, 1)).T
    for cfg in ({"block_m": 16, "block_n": 32, "block_k": 64}, {"block_m": 32, "block_n": 32, "block_k": 64, "split_k": 2}):
        for dot in (torch.float16,):  # Triton 3.6's interpreter computes bf16 tl.dot wrongly (the GPU test has bf16)
            out = tg.fp8_weight_only_gemm(xb, b_q, b_s, out_dtype=torch.float32, dot_dtype=dot, config=cfg)
            err = float((out.double() - ref16).norm() / ref16.norm())
            assert err < 1e-5, (cfg, dot, err)
    # the dispatcher's named path runs the tuned config of this (N, K)
    from lumenrl_quant import gemm
    gemm.TRITON_ROWWISE_CONFIGS[(n, k)] = {"block_m": 16, "block_n": 32, "block_k": 128, "split_k": 4}
    out = gemm.run_gemm_path("triton_rowwise", a_q, a_s, b_q, b_s, out_dtype=torch.float32)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
    # pdl=True: the opaque op (it launches plainly here, no PDL off CUDA sm90+), eager and under fullgraph compile
    cfg = {"block_m": 16, "block_n": 32, "block_k": 128, "split_k": 1}
    plain = tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, out_dtype=torch.float32, config=cfg)
    assert float((plain.double() - ref).norm() / ref.norm()) < 1e-6
    assert torch.equal(tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, out_dtype=torch.float32, config=cfg, pdl=True), plain)
    for prefetch in (0, 128, 4096):  # bytes of each weight row prefetched before the wait: where, not what
        assert torch.equal(tg.fp8_rowwise_gemm(a_q, a_s, b_q, b_s, out_dtype=torch.float32, config=cfg, pdl=True,
                                               prefetch=prefetch), plain)
    compiled = torch.compile(lambda a, s: tg.fp8_rowwise_gemm(a, s, b_q, b_s, out_dtype=torch.float32, config=cfg,
                                                              pdl=True), fullgraph=True)
    assert torch.equal(compiled(a_q, a_s), plain)
    with_tma = torch.compile(lambda a, s: tg.fp8_rowwise_gemm(a, s, b_q, b_s, out_dtype=torch.float32,
                                                              config={**cfg, "tma": 1}), fullgraph=True)
    assert torch.equal(with_tma(a_q, a_s), plain)  # TMA runs in the opaque op, with or without PDL
    # one activation scale for every row (a per-tensor scale, e.g. the FP8 cache's V scale for o_proj), given as
    # one element or as a broadcast view of one: read as it is, the same result as the materialized (M, 1) column
    one = a_s[:1].reshape(1, 1) * 1.5
    column = one.expand(m, 1).contiguous()
    for c in (cfg, {"block_m": 16, "block_n": 64, "block_k": 64, "split_k": 2}):
        want = tg.fp8_rowwise_gemm(a_q, column, b_q, b_s, out_dtype=torch.float32, config=c)
        for scale in (one.expand(m, 1), one.reshape(1)):
            for pdl in (False, True):
                assert torch.equal(tg.fp8_rowwise_gemm(a_q, scale, b_q, b_s, out_dtype=torch.float32, config=c, pdl=pdl),
                                   want), (c, tuple(scale.shape), pdl)
    assert torch.equal(compiled(a_q, one.expand(m, 1)), tg.fp8_rowwise_gemm(a_q, column, b_q, b_s, out_dtype=torch.float32,
                                                                          config=cfg))
    # ... and under compile the broadcast scale reaches the op as it is: no kernel materializes an (M,) copy
    from torch._inductor.utils import run_and_get_code
    per_tensor = torch.compile(lambda a, v: tg.fp8_rowwise_gemm(a, v.reshape(1, 1).expand(a.shape[0], 1), b_q, b_s,
                                                                out_dtype=torch.float32, config=cfg, pdl=True))
    _, (code,) = run_and_get_code(per_tensor, a_q, one.reshape(1))
    body = code[code.index("def call("):]
    assert "fp8_rowwise_gemm_pdl" in body and "cpp_fused" not in body, body
    print(worst)
    """
)


def test_rowwise_gemm_matches_float64_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-6


@pytest.mark.parametrize("prefetch", [-1, 1.5, True])
def test_bad_prefetch_is_refused_naming_it(prefetch):
    import torch

    from lumenrl_quant import triton_gemm as tg

    a_q, b_q = torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(32, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"prefetch=.*allowed: an int >= 0"):
        tg.fp8_rowwise_gemm(a_q, torch.ones(4, 1), b_q, torch.ones(32, 1), pdl=True, prefetch=prefetch)


@pytest.mark.parametrize(("config", "named"), [
    ({"block_n": 48}, "block_n=48"), ({"split_k": 3}, "split_k=3"), ({"num_stages": 0}, "num_stages=0"),
    ({"stages": 2}, "['stages']"), ({"tma": 2}, "tma=2"), ({"tma": True}, "tma=True"),
])
def test_rowwise_gemm_config_errors_name_the_bad_value(config, named):
    import re

    from lumenrl_quant import triton_gemm

    with pytest.raises(ValueError, match=re.escape(named)):
        triton_gemm._config(config)


def test_tma_needs_aligned_operands():
    """A row stride off 16 bytes is named (the launch then loads with pointers)."""
    import torch

    from lumenrl_quant import triton_gemm

    if triton_gemm.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    codes = torch.zeros(4, 144, dtype=torch.float8_e4m3fn)
    assert triton_gemm.tma_reason(codes[:, :128]) is None
    assert "16-byte aligned" in triton_gemm.tma_reason(torch.zeros(4, 132, dtype=torch.float8_e4m3fn)[:, :128])


def test_weight_only_gemm_names_bad_dtypes():
    import torch

    from lumenrl_quant import triton_gemm

    w = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dot_dtype=torch.float32"):
        triton_gemm.fp8_weight_only_gemm(torch.zeros(2, 128, dtype=torch.bfloat16), w, torch.ones(4),
                                         dot_dtype=torch.float32)
    with pytest.raises(ValueError, match="x dtype=torch.float32"):
        triton_gemm.fp8_weight_only_gemm(torch.zeros(2, 128), w, torch.ones(4))


def test_rowwise_gemm_refuses_k_not_a_multiple_of_the_split():
    import torch

    from lumenrl_quant import triton_gemm

    a = torch.zeros(4, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K=200"):
        triton_gemm.fp8_rowwise_gemm(a, torch.ones(4), a, torch.ones(4), config={"block_k": 64})
