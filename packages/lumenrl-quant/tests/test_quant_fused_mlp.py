"""The fused FP8 SwiGLU MLP (``lumenrl_quant.fused_mlp``) and its two Triton kernels.

* CPU (torch backend): against a float64 MLP on fresh random weights with outlier tokens; at least
  as accurate as the unfused per-token FP8 path; traced by ``torch.compile(fullgraph=True)``;
  unsupported layers and bad arguments are refused naming the value.
* Triton interpreter (subprocess: ``TRITON_INTERPRET`` is read when kernels are decorated): the
  gate/up + SiLU * up + 1 x group quantize kernel and the group-scaled down GEMM against float64
  products of the same FP8 codes, M not a multiple of the tile, split-K, and the whole MLP against
  the torch backend. The interpreter's own FP8 cast does not round like CUDA, so codes are compared
  on the GPU (test at the end), dequantized values here.
* The per-token variant (``silu_mul_quantize``, ``swiglu_mlp_fp8_tokenwise``): float64 bounds, the
  same numbers as the unfused modules, compile, ``QuantizedLinear.forward_quantized``'s checks, and
  its Triton kernel in the interpreter (one pass and two passes per row) and on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lumenrl_quant import QuantizedLinear, sqnr_db
from lumenrl_quant.fused_mlp import (
    silu_mul_quantize,
    swiglu_mlp_fp8,
    swiglu_mlp_fp8_supported,
    swiglu_mlp_fp8_tokenwise,
    swiglu_quantize_reference,
)


def _mlp(k: int, inter: int, *, seed: int, scheme: str = "fp8_row", device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    w_gate, w_up = torch.randn(inter, k, generator=gen) * 0.05, torch.randn(inter, k, generator=gen) * 0.05
    w_down = torch.randn(k, inter, generator=gen) * 0.05
    gate_up = QuantizedLinear(k, 2 * inter, scheme=scheme, bias=False, weight=torch.cat([w_gate, w_up]).to(device),
                              device=device)
    down = QuantizedLinear(inter, k, scheme=scheme, bias=False, weight=w_down.to(device), device=device)
    return (w_gate, w_up, w_down), gate_up, down


def _reference(x: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    x = x.double()
    g, u = x @ w_gate.double().T, x @ w_up.double().T
    return (torch.nn.functional.silu(g) * u) @ w_down.double().T


def test_fused_mlp_matches_float64_and_beats_per_token_quantization():
    (wg, wu, wd), gate_up, down = _mlp(256, 512, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, 256, generator=gen)
    x[3] *= 40.0  # an outlier token
    ref = _reference(x, wg, wu, wd)
    fused = swiglu_mlp_fp8(x, gate_up, down, backend="torch")
    gu = gate_up(x)
    unfused = down(torch.nn.functional.silu(gu[:, :512]) * gu[:, 512:])
    assert fused.shape == (24, 256) and fused.dtype == x.dtype
    fused_db, unfused_db = sqnr_db(ref, fused.double()), sqnr_db(ref, unfused.double())
    assert fused_db >= 25.0, fused_db
    assert fused_db >= unfused_db - 0.1, (fused_db, unfused_db)  # finer scales: never worse (1e-1 dB slack)


def test_swiglu_quantize_reference_blocks_and_zero_block():
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(6, 128, generator=gen, dtype=torch.float64), torch.randn(6, 128, generator=gen,
                                                                                       dtype=torch.float64)
    up[2, :64] = 0.0  # an all-zero block gets scale 1
    q, s = swiglu_quantize_reference(gate, up, group=64)
    assert q.shape == (6, 128) and s.shape == (6, 2) and s[2, 0] == 1.0
    h = torch.nn.functional.silu(gate) * up
    assert torch.allclose(s[:, 1].double(), h[:, 64:].abs().amax(1) / 448.0, rtol=1e-6)
    assert sqnr_db(h, q.double() * s.double().repeat_interleave(64, 1)) >= 25.0


def test_fused_mlp_leading_dims_and_compile():
    (wg, wu, wd), gate_up, down = _mlp(128, 256, seed=4)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    eager = swiglu_mlp_fp8(x, gate_up, down)
    assert eager.shape == (2, 3, 128) and eager.dtype == torch.bfloat16
    compiled = torch.compile(lambda t: swiglu_mlp_fp8(t, gate_up, down), fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(compiled.float(), eager.float(), rtol=2e-2, atol=1e-3)
    assert sqnr_db(_reference(x.float(), wg, wu, wd), eager.double()) >= 22.0


def test_unsupported_layers_and_bad_arguments_are_named():
    _, gate_up, down = _mlp(128, 256, seed=6, scheme="fp8_block")
    assert "scheme='fp8_block'" in swiglu_mlp_fp8_supported(gate_up, down)
    _, gate_up, down = _mlp(128, 256, seed=6)
    assert swiglu_mlp_fp8_supported(gate_up, down) is None
    assert "multiple of group=512" in swiglu_mlp_fp8_supported(gate_up, down, group=512)
    with pytest.raises(ValueError, match="backend='cuda'"):
        swiglu_mlp_fp8(torch.randn(2, 128), gate_up, down, backend="cuda")
    biased = QuantizedLinear(256, 128, scheme="fp8_row", bias=True, weight=torch.randn(128, 256))
    with pytest.raises(ValueError, match="down has a bias"):
        swiglu_mlp_fp8(torch.randn(2, 128), gate_up, biased)
    from lumenrl_quant import triton_gemm

    with pytest.raises(ValueError, match="group=48"):
        triton_gemm._swiglu_config({"group": 48})
    with pytest.raises(ValueError, match=r"\['split'\]"):
        triton_gemm._swiglu_config({"split": 2})


def test_launch_configs_are_refused_where_the_torch_path_runs(monkeypatch):
    import lumenrl_quant.fused_mlp as fused_mlp

    monkeypatch.setattr(fused_mlp, "_triton_ok", lambda *args: False)  # auto: the torch path (as on the CPU)
    (wg, wu, wd), gate_up, down = _mlp(128, 256, seed=7)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8))
    cfgs = ({"block_m": 16}, None)
    for backend in ("torch", "auto"):
        with pytest.raises(ValueError, match=rf"^configs=.* but backend='{backend}' runs the torch path"):
            swiglu_mlp_fp8(x, gate_up, down, backend=backend, configs=cfgs)
    with pytest.raises(ValueError, match=r"^configs=\{'block_m': 16\}; allowed: None or \(gate/up config"):
        swiglu_mlp_fp8(x, gate_up, down, backend="torch", configs={"block_m": 16})
    ref = swiglu_mlp_fp8(x, gate_up, down, backend="torch")
    for unset in (None, (None, None), ({}, {})):  # the neighbours: no launch setting given
        assert torch.equal(swiglu_mlp_fp8(x, gate_up, down, backend="auto", configs=unset), ref)
    assert sqnr_db(_reference(x, wg, wu, wd), ref.double()) >= 20.0  # E4M3 (measured 24.5 dB)


def test_silu_mul_quantize_per_token_against_float64():
    gen = torch.Generator().manual_seed(11)
    gu = torch.randn(2, 9, 2 * 160, generator=gen, dtype=torch.float64) * 2.0
    gu[0, 3] *= 50.0  # an outlier token: its scale is its own
    gu[1, 4] = 0.0  # an all-zero token: scale 1, codes 0
    codes, scales = silu_mul_quantize(gu.float(), backend="torch")
    assert codes.shape == (2, 9, 160) and codes.dtype == torch.float8_e4m3fn and scales.shape == (2, 9, 1)
    g, u = gu[..., :160], gu[..., 160:]
    h = torch.nn.functional.silu(g) * u
    amax = h.abs().amax(-1, keepdim=True)
    ok = amax > 0
    assert float(((scales.double() - amax / 448.0).abs() / amax.clamp_min(1e-30) * 448.0)[ok].max()) < 1e-6
    assert torch.equal(scales[1, 4], torch.ones(1)) and not codes[1, 4].float().any()
    deq = codes.double() * scales.double()
    assert sqnr_db(h, deq) >= 28.0  # E4M3 per token (3 mantissa bits): ~31 dB on Gaussian-like rows
    with pytest.raises(ValueError, match="odd"):
        silu_mul_quantize(torch.randn(3, 7))
    with pytest.raises(ValueError, match="backend='gpu'"):
        silu_mul_quantize(torch.randn(3, 8), backend="gpu")


def test_tokenwise_mlp_is_the_unfused_per_token_math_and_compiles():
    (wg, wu, wd), gate_up, down = _mlp(256, 512, seed=12)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, 5, 256, generator=gen)
    x[1, 2] *= 40.0
    out = swiglu_mlp_fp8_tokenwise(x, gate_up, down, backend="torch")
    gu = gate_up(x)
    unfused = down(torch.nn.functional.silu(gu[..., :512]) * gu[..., 512:])  # float32 h: the same quantization
    assert out.shape == (3, 5, 256) and torch.allclose(out, unfused, rtol=1e-5, atol=1e-6)
    assert sqnr_db(_reference(x.reshape(-1, 256), wg, wu, wd), out.reshape(-1, 256).double()) >= 20.0  # 23.0 measured
    compiled = torch.compile(lambda t: swiglu_mlp_fp8_tokenwise(t, gate_up, down), fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x), out, rtol=1e-5, atol=1e-6)
    # a bias is fine here (the GEMM epilogues add it); other schemes and shapes are refused by name
    biased = QuantizedLinear(512, 256, scheme="fp8_row", bias=True, weight=wd)
    assert swiglu_mlp_fp8_supported(gate_up, biased, tokenwise=True) is None
    blocky = QuantizedLinear(512, 256, scheme="fp8_block", bias=False, weight=wd)
    with pytest.raises(ValueError, match="down scheme='fp8_block'"):
        swiglu_mlp_fp8_tokenwise(x, gate_up, blocky)


def test_forward_quantized_matches_forward_and_names_bad_operands():
    _, gate_up, down = _mlp(128, 256, seed=14)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(15))
    from lumenrl_quant.fp8 import quantize_fp8

    a_q, a_s = quantize_fp8(x, granularity="rowwise", backend="torch")
    assert torch.equal(down.forward_quantized(a_q, a_s, torch.float32), down(x))
    assert down.forward_quantized(a_q[:0], a_s[:0], torch.float32).shape == (0, 128)
    with pytest.raises(ValueError, match=r"a_scale shape \(6, 2\)"):
        down.forward_quantized(a_q, a_s.expand(6, 2), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        down.forward_quantized(a_q.to(torch.float8_e5m2), a_s, torch.float32)
    blocky = QuantizedLinear(256, 128, scheme="fp8_block", bias=False, weight=torch.randn(128, 256))
    with pytest.raises(ValueError, match="scheme='fp8_block'"):
        blocky.forward_quantized(a_q, a_s, torch.float32)


SILU_SCRIPT = textwrap.dedent(
    """
    import torch
    from lumenrl_quant import triton_swiglu as ts
    from lumenrl_quant.fused_mlp import silu_mul_quantize

    torch.manual_seed(0)
    worst = 0.0
    for m, inter, cfg in ((7, 96, None), (3, 300, {"block": 64, "num_warps": 4}), (4, 256, {"block": 128})):
        gu = torch.randn(m, 2 * inter) * 3.0
        gu[1] *= 20.0
        q, s = ts.fp8_silu_mul_quantize(gu, config=cfg)
        assert q.shape == (m, inter) and s.shape == (m, 1), (q.shape, s.shape)
        g, u = gu.double().chunk(2, -1)
        h = torch.nn.functional.silu(g) * u
        amax = h.abs().amax(-1, keepdim=True)
        worst = max(worst, float(((s.double() - amax / 448.0) / (amax / 448.0)).abs().max()))
        err = float((q.double() * s.double() - h).norm() / h.norm())
        assert err < 0.1, (m, inter, err)  # the interpreter's FP8 cast is coarser than CUDA's
        ref_q, ref_s = silu_mul_quantize(gu, backend="torch")
        assert torch.allclose(s, ref_s, rtol=1e-6), (s, ref_s)
    try:
        ts.fp8_silu_mul_quantize(torch.randn(2, 7))
        raise SystemExit("an odd width was accepted")
    except ValueError as e:
        assert "(2, 7)" in str(e), e
    print(worst)
    """
)


def _interpreted_last_line(script: str) -> float:
    """Run ``script`` in a fresh process under Triton's interpreter (``TRITON_INTERPRET`` is read when
    kernels are decorated); its last printed line as a float."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_silu_mul_quantize_kernel_in_the_interpreter():
    assert _interpreted_last_line(SILU_SCRIPT) < 1e-6


SCRIPT = textwrap.dedent(
    """
    import torch
    from lumenrl_quant import QuantizedLinear, triton_gemm as tg
    from lumenrl_quant.fp8 import quantize_fp8
    from lumenrl_quant.fused_mlp import swiglu_mlp_fp8

    torch.manual_seed(0)
    m, k, inter = 21, 256, 128  # M not a multiple of block_m
    x = torch.randn(m, k)
    x[4] *= 30.0
    w = torch.randn(2 * inter, k) * 0.05
    a_q, a_s = quantize_fp8(x, granularity="rowwise", backend="torch")
    w_q, w_s = quantize_fp8(w, granularity="rowwise", backend="torch")
    gu = (a_q.double() * a_s.double()) @ (w_q.double() * w_s.double()).T
    g, u = gu[:, :inter], gu[:, inter:]
    h = g * torch.sigmoid(g) * u
    worst = 0.0
    for group, block_m, block_k in ((32, 16, 64), (64, 16, 128), (64, 32, 32)):
        q, s = tg.fp8_swiglu_quant(a_q, a_s, w_q, w_s, out_dtype=torch.float8_e4m3fn,
                                   config={"group": group, "block_m": block_m, "block_k": block_k})
        assert q.shape == (m, inter) and q.dtype == torch.float8_e4m3fn and s.shape == (m, inter // group)
        assert s.stride(0) == 1  # group-major storage
        amax = h.reshape(m, inter // group, group).abs().amax(-1)
        assert float(((s.double() - amax / 448.0).abs() / (amax / 448.0)).max()) < 1e-5, group
        deq = q.double() * s.double().repeat_interleave(group, 1)
        err = float((deq - h).norm() / h.norm())
        assert err < 0.08, (group, err)  # E4M3 rounding (the interpreter's cast is coarser than CUDA's)
        d = torch.randn(96, inter) * 0.05
        d_q, d_s = quantize_fp8(d, granularity="rowwise", backend="torch")
        ref = deq @ (d_q.double() * d_s.double()).T
        for cfg in ({"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 1},
                    {"block_m": 32, "block_n": 64, "block_k": group, "split_k": 2}):
            for scales in (s, s.contiguous()):  # group-major (the kernel's) and row-major scale storage
                out = tg.fp8_group_act_gemm(q, scales, d_q, d_s, group=group, out_dtype=torch.float32, config=cfg)
                e = float((out.double() - ref).norm() / ref.norm())
                assert e < 1e-6, (group, cfg, e)
                worst = max(worst, e)
    try:
        tg.fp8_group_act_gemm(q, s, d_q, d_s, group=64, config={"block_k": 128})
        raise SystemExit("block_k > group was accepted")
    except ValueError as err:
        assert "group=64" in str(err), err
    # the whole MLP: Triton kernels against the torch backend (same quantization, dequantized operands)
    gate_up = QuantizedLinear(k, 2 * inter, scheme="fp8_row", bias=False, weight=w)
    down = QuantizedLinear(inter, 96, scheme="fp8_row", bias=False, weight=torch.randn(96, inter) * 0.05)
    cfgs = ({"block_m": 16, "block_k": 64}, {"block_m": 16, "block_n": 32, "block_k": 32})
    tri = swiglu_mlp_fp8(x, gate_up, down, backend="triton", configs=cfgs)
    ref = swiglu_mlp_fp8(x, gate_up, down, backend="torch")
    xd, gd = x.double(), gate_up.dequantized_weight(torch.float64)
    exact = (torch.nn.functional.silu(xd @ gd[:inter].T) * (xd @ gd[inter:].T)) @ down.dequantized_weight(torch.float64).T
    rel_tri, rel_ref = (float((o.double() - exact).norm() / exact.norm()) for o in (tri, ref))
    assert rel_ref < 0.05 and rel_tri < 0.1, (rel_tri, rel_ref)  # the interpreter's FP8 cast is coarser
    print(worst)
    """
)


def test_fused_mlp_kernels_in_the_interpreter():
    assert _interpreted_last_line(SCRIPT) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU (sm_89+)")
@pytest.mark.parametrize("m", [1, 7, 64, 200])
def test_fused_mlp_gpu_matches_torch_backend(m):
    (wg, wu, wd), gate_up, down = _mlp(1024, 2048, seed=7, device="cuda")
    x = torch.randn(m, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).bfloat16()
    tri = swiglu_mlp_fp8(x, gate_up, down, backend="triton")
    ref = swiglu_mlp_fp8(x, gate_up, down, backend="torch")
    assert sqnr_db(ref.double(), tri.double()) >= 35.0
    exact = _reference(x.float().cpu(), wg, wu, wd)
    assert sqnr_db(exact, tri.double().cpu()) >= 22.0
    # Hopper's FP8 MMA accumulates with fewer mantissa bits than float32 (~1e-3 relative): block scales
    # agree to that, the dequantized blocks by SQNR
    from lumenrl_quant import triton_gemm as tg
    from lumenrl_quant.fp8 import quantize_fp8

    a_q, a_s = quantize_fp8(x, granularity="rowwise", backend="torch")
    q, s = tg.fp8_swiglu_quant(a_q, a_s, gate_up.weight, gate_up.weight_scale, out_dtype=down.fp8_dtype)
    gu = (a_q.double() * a_s.double()) @ (gate_up.weight.double() * gate_up.weight_scale.double()).T
    rq, rs = swiglu_quantize_reference(gu[:, :2048], gu[:, 2048:], group=128)
    assert s.shape == (m, 2048 // 128) and s.stride(0) == 1  # group-major, as the down GEMM reads it
    assert torch.allclose(s, rs.float(), rtol=5e-3)
    assert sqnr_db(rq.double() * rs.double().repeat_interleave(128, 1),
                   q.double() * s.double().repeat_interleave(128, 1)) >= 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU (sm_89+)")
@pytest.mark.parametrize(("m", "inter", "config"), [
    (1, 2048, None), (64, 12288, None), (5, 20000, None), (64, 12288, {"split": 1, "block": 16384, "num_warps": 16}),
    (64, 12288, {"split": 2, "block": 2048}), (3, 6144, {"split": 8, "block": 256}), (300, 1024, None),
])
def test_silu_mul_quantize_gpu_matches_torch(m, inter, config):
    from lumenrl_quant import triton_swiglu as ts

    gen = torch.Generator(device="cuda").manual_seed(m)
    gu = (torch.randn(m, 2 * inter, device="cuda", generator=gen) * 2.0).bfloat16()
    gu[m // 2] *= 30.0  # an outlier row
    q, s = ts.fp8_silu_mul_quantize(gu, config=config)
    rq, rs = silu_mul_quantize(gu, backend="torch")
    assert torch.allclose(s, rs, rtol=1e-6)  # amax / 448 rounded the same way (div_rn)
    # exp and the reciprocal in the kernel may differ from torch's by an ulp: a code can flip at a tie
    assert float((q.float() != rq.float()).float().mean()) < 1e-3
    g, u = gu.double().chunk(2, -1)
    assert sqnr_db(torch.nn.functional.silu(g) * u, q.double() * s.double()) >= 28.0
    # the split form's barrier is reused call after call (no reset): replay it in a CUDA graph
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ts.fp8_silu_mul_quantize(gu, config=config)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        gq, gs = ts.fp8_silu_mul_quantize(gu, config=config)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gq.float(), q.float()) and torch.equal(gs, s)
    compiled = torch.compile(lambda t: silu_mul_quantize(t), fullgraph=True)
    cq, cs = compiled(gu)
    assert torch.allclose(cs, s, rtol=1e-6) and float((cq.float() != q.float()).float().mean()) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU (sm_89+)")
def test_tokenwise_mlp_gpu_matches_torch_backend():
    (wg, wu, wd), gate_up, down = _mlp(1024, 2048, seed=8, device="cuda")
    x = torch.randn(64, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)).bfloat16()
    tri = swiglu_mlp_fp8_tokenwise(x, gate_up, down, backend="triton")
    ref = swiglu_mlp_fp8_tokenwise(x, gate_up, down, backend="torch")
    assert sqnr_db(ref.double(), tri.double()) >= 35.0
    assert sqnr_db(_reference(x.float().cpu(), wg, wu, wd), tri.double().cpu()) >= 22.0


def test_rmsnorm_quantize_matches_normalise_then_quantize_and_float64():
    from lumenrl_quant import rmsnorm_quantize_fp8
    from lumenrl_quant.fused_norm import rmsnorm_quantize_reference

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 7, 512, generator=gen) * 3.0
    x[0, 2] *= 100.0  # an outlier token
    x[1, 4] = 0.0  # an all-zero token: scale 1, codes 0
    w = torch.rand(512, generator=gen) * 2.0 + 0.1
    w[5] = 40.0  # an outlier channel of the norm weight
    codes, scales = rmsnorm_quantize_fp8(x, w, 1e-6)
    ref_codes, ref_scales = rmsnorm_quantize_reference(x, w, 1e-6)
    assert codes.shape == x.shape and scales.shape == (3, 7, 1) and codes.dtype == torch.float8_e4m3fn
    assert torch.allclose(scales, ref_scales, rtol=1e-5)
    assert float((codes.float() != ref_codes.float()).float().mean()) < 1e-3  # float32 rounding at ties only
    assert torch.equal(scales[1, 4], torch.ones(1)) and not codes[1, 4].float().any()
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    ok = x.abs().amax(-1) > 0
    assert sqnr_db(exact[ok], (codes.double() * scales.double())[ok]) >= 28.0
    with pytest.raises(ValueError, match=r"weight shape \(511,\)"):
        rmsnorm_quantize_fp8(x, w[:511], 1e-6)
    with pytest.raises(ValueError, match="eps=-1"):
        rmsnorm_quantize_fp8(x, w, -1.0)
    compiled = torch.compile(lambda t: rmsnorm_quantize_fp8(t, w, 1e-6), fullgraph=True, backend="eager")
    c2, s2 = compiled(x)
    assert torch.equal(c2.float(), codes.float()) and torch.equal(s2, scales)
