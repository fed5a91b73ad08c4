"""``fused_moe``: the expert sort, the Triton grouped GEMMs (CPU interpreter) and FP8 expert weights.

Against a float64 reference of the HF experts formula (``fused_moe_reference`` on float64 copies of the
same inputs / of the dequantized FP8 weights), on fresh random inputs: tiny shapes E=8, k=2, H=64, I=32,
N in {1, 5, 17} (N*k never a multiple of the block), bf16 and fp32 activations, launch configurations
with and without K tails, experts that receive no token. Bounds: fp32 relative error < 1e-5 (float32
summation order); bf16 < 5e-3 (three roundings to bf16: SiLU * up, each weighted pair, the output;
measured ~3e-3, the HF formula in bf16 ~4e-3). The Triton part runs in a subprocess because
``TRITON_INTERPRET`` must be set before the kernels are decorated. The GPU test captures the layer in
a CUDA graph at the Qwen3-30B-A3B layer shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lumenrl_quant.moe import (
    FusedMoEConfig,
    MoETile,
    dequantize_experts_fp8,
    fused_moe,
    fused_moe_config,
    fused_moe_reference,
    moe_align,
    quantize_experts_fp8,
)

E, K, H, INTER = 8, 2, 64, 32
# W8A8 against its float64 reference, which rounds the activations to the same 1 x 128 FP8 groups: the
# scales are computed in float64 there, so a value on a rounding boundary can take the neighbouring code
# (one FP8 step, ~6% of that element), and the 16-bit rounding of silu(gate) * up differs in order
A8_BOUND = 2e-2


def _inputs(n: int, dtype: torch.dtype, gen: torch.Generator, experts: int = E):
    """Random layer inputs routed top-k among the first ``experts`` experts (the others get no token)."""
    x = torch.randn(n, H, generator=gen).to(dtype)
    w1 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.1).to(dtype)
    probs = torch.randn(n, experts, generator=gen).softmax(-1)
    weights, ids = probs.topk(K, dim=-1)
    return x, w1, w2, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


SCRIPT = textwrap.dedent(
    """
    import torch
    from lumenrl_quant.moe import FusedMoEConfig, MoETile, fused_moe, fused_moe_reference, quantize_experts_fp8
    from test_quant_fused_moe import A8_BOUND, E, _inputs, _rel

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    configs = [None,  # the decode default: block_k 128 > H, masked K tail
               FusedMoEConfig(block_m=16, gate_up=MoETile(block_n=16, block_k=32), down=MoETile(block_n=32, block_k=32)),
               FusedMoEConfig(block_m=32, gate_up=MoETile(block_n=32, block_k=64), down=MoETile(block_n=16, block_k=16))]
    bound = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
    worst = {}
    # every N with both dtypes, every config with both dtypes; "used" 3: five experts receive no token
    cases = [(1, torch.float32, E), (1, torch.bfloat16, 3), (5, torch.float32, 3), (5, torch.bfloat16, E),
             (17, torch.float32, E), (17, torch.bfloat16, 3)]
    for i, (n, dtype, used) in enumerate(cases):
        cfg = configs[i % len(configs)]
        x, w1, w2, ids, tw = _inputs(n, dtype, gen, used)
        ref = fused_moe_reference(x.double(), w1.double(), w2.double(), ids, tw.double())
        q1, s1 = quantize_experts_fp8(w1)
        q2, s2 = quantize_experts_fp8(w2)
        ref8 = fused_moe_reference(x.double(), q1, q2, ids, tw.double(), w_gate_up_scale=s1, w_down_scale=s2)
        out = fused_moe(x, w1, w2, ids, tw, config=cfg, backend="triton")
        out8 = fused_moe(x, q1, q2, ids, tw, w_gate_up_scale=s1, w_down_scale=s2, config=cfg, backend="triton")
        ref_a8 = fused_moe_reference(x.double(), q1, q2, ids, tw.double(), w_gate_up_scale=s1, w_down_scale=s2,
                                     fp8_activations=True, inter_dtype=dtype)
        a8_cfg = None if cfg is None else FusedMoEConfig(block_m=cfg.block_m, gate_up=cfg.gate_up,
                                                         down=MoETile(block_n=cfg.down.block_n, block_k=32))
        out_a8 = fused_moe(x, q1, q2, ids, tw, w_gate_up_scale=s1, w_down_scale=s2, config=a8_cfg, backend="triton",
                           fp8_activations=True)
        for name, got, want in (("bf", out, ref), ("fp8", out8, ref8), ("w8a8", out_a8, ref_a8)):
            assert got.dtype == dtype and got.shape == x.shape
            err = _rel(got, want)
            assert err < (A8_BOUND if name == "w8a8" else bound[dtype]), (name, n, dtype, used, cfg, err)
            worst[(name, str(dtype))] = max(worst.get((name, str(dtype)), 0.0), err)
    # the Triton align (atomic placement): the torch align's block experts, the same pairs in every block
    from lumenrl_quant.moe import moe_align, num_align_blocks
    from lumenrl_quant.triton_moe import moe_align_triton
    for n, k, e, block_m in ((1, 2, 8, 16), (17, 2, 8, 32), (64, 8, 128, 16), (300, 8, 128, 64), (3, 2, 6, 16)):
        ids = torch.randn(n, e, generator=gen).topk(k, dim=-1).indices
        pairs, blocks = moe_align(ids, e, block_m)
        pairs_t, blocks_t = moe_align_triton(ids, e, block_m, num_align_blocks(n * k, e, block_m))
        assert torch.equal(blocks, blocks_t), (n, k, e, block_m)
        same = pairs.view(-1, block_m).sort(-1).values == pairs_t.view(-1, block_m).sort(-1).values
        assert same.all(), (n, k, e, block_m)
    # the custom op traces whole under dynamo (fake shapes), and runs
    f = torch.compile(lambda *a: fused_moe(*a, backend="triton"), backend="aot_eager", fullgraph=True)
    x, w1, w2, ids, tw = _inputs(5, torch.float32, gen)
    assert _rel(f(x, w1, w2, ids, tw), fused_moe_reference(x.double(), w1.double(), w2.double(), ids, tw.double())) < 1e-5
    print(worst)
    """
)


def test_triton_fused_moe_matches_float64_in_the_interpreter():
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("n", [1, 5, 17, 64])
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_puts_every_pair_once_in_single_expert_blocks(n, block_m):
    gen = torch.Generator().manual_seed(n)
    ids = torch.randn(n, E, generator=gen)[:, :5].topk(K, dim=-1).indices  # experts 5..7 get nothing
    pairs, block_experts = moe_align(ids, E, block_m)
    s = n * K
    assert pairs.numel() == block_experts.numel() * block_m >= s + min(s, E) * (block_m - 1)
    real = pairs[pairs < s]
    assert sorted(real.tolist()) == list(range(s))  # each pair exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_experts.tolist()):
        rows = pairs[b * block_m:(b + 1) * block_m]
        if e == E:  # unused tail: only padding
            assert (rows == s).all()
            continue
        members = rows[rows < s].long()
        assert members.numel() > 0 and (flat[members] == e).all()
    used = block_experts[block_experts < E]
    assert torch.equal(used, used.sort().values)  # experts in order, tail at the end
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(torch.bincount(used.long(), minlength=E), (counts + block_m - 1) // block_m)


def test_torch_backend_matches_float64_and_bf16_weights_are_refused_with_float_hidden():
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x, w1, w2, ids, tw = _inputs(17, torch.float32, gen)
    ref = fused_moe_reference(x.double(), w1.double(), w2.double(), ids, tw.double())
    assert _rel(fused_moe(x, w1, w2, ids, tw, backend="torch"), ref) < 1e-6
    # W8A8 on the torch backend: the float64 reference with the same activation rounding; and that rounding
    # is real (far from the w8a16 result at this bound's scale, close to it at FP8 resolution)
    (q1, s1), (q2, s2) = quantize_experts_fp8(w1), quantize_experts_fp8(w2)
    scales = {"w_gate_up_scale": s1, "w_down_scale": s2}
    a8 = fused_moe(x, q1, q2, ids, tw, backend="torch", fp8_activations=True, **scales)
    ref_a8 = fused_moe_reference(x.double(), q1, q2, ids, tw.double(), fp8_activations=True, inter_dtype=x.dtype,
                                 **scales)
    w8a16 = fused_moe_reference(x.double(), q1, q2, ids, tw.double(), **scales)
    assert _rel(a8, ref_a8) < A8_BOUND
    assert 1e-4 < _rel(a8, w8a16) < 0.1
    with pytest.raises(ValueError, match="fp8_activations=True needs FP8 expert weights"):
        fused_moe(x, w1, w2, ids, tw, fp8_activations=True)
    with pytest.raises(ValueError, match="one dtype"):
        fused_moe(x, w1.bfloat16(), w2.bfloat16(), ids, tw, backend="torch")


def test_fp8_expert_weights_round_trip_per_block():
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    w = torch.randn(3, 200, 160, generator=gen)  # partial blocks both ways
    q, s = quantize_experts_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 2)
    back = dequantize_experts_fp8(q, s, torch.float64)
    assert _rel(back, w.double()) < 0.04  # E4M3: 3 mantissa bits
    again = (torch.empty_like(q), torch.empty_like(s))
    quantize_experts_fp8(w, out=again)  # in place into existing buffers: the same codes and scales
    assert torch.equal(again[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again[1], s)


@pytest.mark.parametrize(("config", "named"), [
    (FusedMoEConfig(block_m=8), "block_m=8"),
    (FusedMoEConfig(gate_up=MoETile(block_n=48)), "gate_up.block_n=48"),
    (FusedMoEConfig(down=MoETile(num_stages=0)), "down.num_stages=0"),
])
def test_bad_configs_name_the_field(config, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        config.check(fp8=False)


def test_fp8_needs_k_tiles_inside_one_scale_block_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"down\.block_k=256"):
        FusedMoEConfig(down=MoETile(block_k=256)).check(fp8=True)
    x = torch.zeros(2, H)
    w1, w2 = torch.zeros(E, 2 * INTER, H), torch.zeros(E, H, INTER)
    ids, tw = torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, K)
    with pytest.raises(ValueError, match="w_gate_up"):
        fused_moe(x, w1[:, :, :32], w2, ids, tw)
    with pytest.raises(ValueError, match="both scales"):
        q, s = quantize_experts_fp8(w1)
        fused_moe(x, q, w2, ids, tw, w_gate_up_scale=s)
    with pytest.raises(ValueError, match="activation='gelu'"):
        fused_moe(x, w1, w2, ids, tw, activation="gelu")


def test_launch_config_is_refused_where_the_torch_path_runs(monkeypatch):
    import lumenrl_quant.moe as moe

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x, w1, w2, ids, tw = _inputs(5, torch.float32, gen)
    cfg = FusedMoEConfig(block_m=16)
    monkeypatch.setattr(moe, "triton_moe_available", lambda device: False)  # auto: the torch path (CPU)
    for backend in ("torch", "auto"):
        with pytest.raises(ValueError, match=rf"^config=FusedMoEConfig.* but backend='{backend}' runs the torch"):
            fused_moe(x, w1, w2, ids, tw, config=cfg, backend=backend)
    ref = fused_moe_reference(x.double(), w1.double(), w2.double(), ids, tw.double())
    assert _rel(fused_moe(x, w1, w2, ids, tw, backend="auto"), ref) < 1e-6  # the neighbour: no config


def test_quantize_experts_into_out_refuses_another_dtype():
    w = torch.randn(2, 130, 128, generator=torch.Generator().manual_seed(3))
    q, s = quantize_experts_fp8(w, dtype=torch.float8_e5m2)
    assert q.dtype == torch.float8_e5m2
    out = (torch.empty_like(q), torch.empty_like(s))
    with pytest.raises(ValueError, match=r"^dtype=torch\.float8_e4m3fn differs from out's codes dtype "
                                         r"torch\.float8_e5m2"):
        quantize_experts_fp8(w, dtype=torch.float8_e4m3fn, out=out)
    for dtype in (None, torch.float8_e5m2):  # the neighbours: unset, or out's own dtype
        codes, scales = quantize_experts_fp8(w, dtype=dtype, out=out)
        assert codes is out[0] and torch.equal(codes.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s)
    with pytest.raises(ValueError, match=r"out shapes .* allowed: codes \(2, 130, 128\), scales \(2, 2, 1\)"):
        quantize_experts_fp8(w, out=(out[0], torch.empty(2, 1, 1)))


def test_config_heuristic_uses_16_row_blocks_at_decode():
    from lumenrl_quant.moe import DEFAULT_CONFIGS

    assert fused_moe_config(64, 8, 128, 2048, 768).block_m == 16  # ~4 pairs per expert: one block each
    assert fused_moe_config(16384, 8, 128, 2048, 768).block_m == 64
    for _, cfg in DEFAULT_CONFIGS:  # every default also serves FP8 weights (K tiles inside a scale block)
        cfg.check(fp8=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True, "w8a8"])
def test_fused_moe_on_the_gpu_in_a_cuda_graph(fp8):
    """Qwen3-30B-A3B layer shape at decode batch 64 (and a prefill-sized batch): float64 bound, graph = eager."""
    a8 = fp8 == "w8a8"
    gen = torch.Generator(device="cuda").manual_seed(3)
    e, k, h, inter = 128, 8, 2048, 768
    w1 = (torch.randn(e, 2 * inter, h, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=gen, device="cuda") * 0.02).bfloat16()
    scales = {}
    if fp8:
        (w1, s1), (w2, s2) = quantize_experts_fp8(w1), quantize_experts_fp8(w2)
        scales = {"w_gate_up_scale": s1, "w_down_scale": s2}
        if a8:
            scales["fp8_activations"] = True
    for n in (64, 1000):
        x = torch.randn(n, h, generator=gen, device="cuda").bfloat16()
        weights, ids = torch.randn(n, e, generator=gen, device="cuda").softmax(-1).topk(k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        ref = fused_moe_reference(x.double(), w1 if fp8 else w1.double(), w2 if fp8 else w2.double(), ids,
                                  weights.double(), inter_dtype=x.dtype, **scales)
        out = fused_moe(x, w1, w2, ids, weights, **scales)
        assert _rel(out, ref) < (A8_BOUND if a8 else 5e-3), (n, _rel(out, ref))
    graph, static = torch.cuda.CUDAGraph(), fused_moe(x, w1, w2, ids, weights, **scales)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = fused_moe(x, w1, w2, ids, weights, **scales)
    ids.copy_(torch.randn(n, e, generator=gen, device="cuda").topk(k, dim=-1).indices)  # new routes, same buffers
    graph.replay()
    assert torch.equal(static, fused_moe(x, w1, w2, ids, weights, **scales))
