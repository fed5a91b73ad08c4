"""Decode FP8 path: rowwise epilogue GEMM, M = 1 rowwise dispatch, dynamo traceability, in-place reload.

CPU only: the fast GEMM path is forced (``_paths`` / ``run_gemm_path``) and runs through CPU
``torch._scaled_mm`` (tensorwise, float32 out), which is slow but exact enough to check the
epilogue math against float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lumenrl_quant import QuantizedLinear, dequantize_fp8, gemm, quantize_fp8, quantize_model
from lumenrl_quant import fp8 as fp8_mod
from lumenrl_quant.error import sqnr_db
from lumenrl_quant.gemm import gemm_path, rowwise_epilogue, run_gemm_path
from lumenrl_quant.schemes import Fp8Row, get_quant_scheme

FP8_SCHEMES = ["fp8_row", "fp8_block", "fp8_tensor", "fp8_w8a16"]


def fresh(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).float()


def fresh_linear(k: int, n: int, *, bias: bool, seed: int) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(fresh(n, k, seed=seed) * 0.02)
        if bias:
            lin.bias.copy_(fresh(n, seed=seed + 1) * 0.02)
    return lin


def force_fast(q: QuantizedLinear) -> QuantizedLinear:
    """Route every M class of an fp8_row layer through the decode epilogue path (CPU _scaled_mm)."""
    for key in q._paths:
        q._paths[key] = "scaled_mm_rowwise_epilogue"
    return q


def rowwise_operands(m: int, n: int, k: int, seed: int):
    aq, sa = quantize_fp8(fresh(m, k, seed=seed), granularity="rowwise")
    bq, sb = quantize_fp8(fresh(n, k, seed=seed + 7) * 0.02, granularity="rowwise")
    return aq, sa, bq, sb


def test_one_row_activation_scale_is_rowwise_not_emulated(monkeypatch):
    """The M = 1 anomaly: a (1, 1) activation scale was read as tensorwise, the tensor x row mix
    had no fast mode and fp8_row decode at M = 1 ran the float32 emulation."""
    monkeypatch.setattr(gemm, "_device_supports", lambda mode, device, k, out_dtype: True)
    aq, sa, bq, sb = rowwise_operands(1, 64, 128, seed=1)
    assert sa.shape == (1, 1)
    assert gemm_path(aq, sa, bq, sb) == "scaled_mm_rowwise_epilogue"
    monkeypatch.setattr(gemm, "ROWWISE_EPILOGUE_MAX_M", 0)
    assert gemm_path(aq, sa, bq, sb) == "scaled_mm_rowwise"
    aq8, sa8, _, _ = rowwise_operands(300, 64, 128, seed=2)
    monkeypatch.setattr(gemm, "ROWWISE_EPILOGUE_MAX_M", 256)
    assert gemm_path(aq8, sa8, bq, sb) == "scaled_mm_rowwise"  # training-sized M keeps the rowwise kernel


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_rowwise_epilogue_path_equals_float64(m, bias):
    aq, sa, bq, sb = rowwise_operands(m, 48, 96, seed=10 + m)
    b = fresh(48, seed=3) if bias else None
    exact = dequantize_fp8(aq, sa).double() @ dequantize_fp8(bq, sb).double().t()
    if bias:
        exact = exact + b.double()
    out = run_gemm_path("scaled_mm_rowwise_epilogue", aq, sa, bq, sb, out_dtype=torch.float32, bias=b)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    out_bf16 = run_gemm_path("scaled_mm_rowwise_epilogue", aq, sa, bq, sb, out_dtype=torch.bfloat16, bias=b)
    assert out_bf16.dtype == torch.bfloat16 and sqnr_db(exact, out_bf16) >= 45.0  # one bf16 rounding


def test_rowwise_epilogue_eager_equals_functional(monkeypatch):
    acc, sa, sb, bias = fresh(6, 32, seed=4), fresh(6, 1, seed=5).abs(), fresh(32, 1, seed=6).abs(), fresh(32, seed=7)
    ref = (acc.double() * sa.double() * sb.double().t() + bias.double())
    for b, r in ((None, ref - bias.double()), (bias, ref)):
        eager = rowwise_epilogue(acc.clone(), sa, sb, b, torch.float32)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        functional = rowwise_epilogue(acc.clone(), sa, sb, b, torch.float32)
        monkeypatch.undo()
        torch.testing.assert_close(eager.double(), r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(functional, eager, rtol=2e-6, atol=0)  # addcmul may fuse (FMA)


@pytest.mark.parametrize("m", [1, 64])
def test_fp8_row_decode_path_sqnr_vs_float64(m):
    lin = fresh_linear(256, 96, bias=False, seed=20)
    q = force_fast(QuantizedLinear.from_linear(lin, "fp8_row"))
    x = fresh(m, 256, seed=21)
    ref = x.double() @ lin.weight.double().t()
    y = q(x)
    assert q.gemm_path_for(m, torch.float32) == "scaled_mm_rowwise_epilogue"
    assert sqnr_db(ref, y) >= 25.0  # E4M3 W8A8 on Gaussian data: ~28 dB
    emulated = QuantizedLinear.from_linear(lin, "fp8_row")  # CPU default: the exact emulation
    assert emulated.gemm_path_for(m, torch.float32) == "emulated"
    torch.testing.assert_close(y, emulated(x), rtol=1e-5, atol=1e-6)


class NormThenLinear(nn.Module):
    """RMSNorm followed by a quantized linear: the pattern whose act-quant inductor fuses."""

    def __init__(self, q: QuantizedLinear) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(q.in_features, eps=1e-6)
        self.proj = q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_forward_traces_without_graph_breaks(scheme, monkeypatch):
    torch._dynamo.reset()
    q = QuantizedLinear.from_linear(fresh_linear(256, 64, bias=True, seed=30), scheme)
    block = NormThenLinear(q)
    x = fresh(2, 5, 256, seed=31)
    eager = block(x)

    def no_triton(*args, **kwargs):
        raise AssertionError("compiled forward must quantize activations with plain torch ops")

    monkeypatch.setattr(fp8_mod, "_try_triton", no_triton)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)


def test_forced_fast_path_traces_and_follows_in_place_reload():
    torch._dynamo.reset()
    lin, new = fresh_linear(64, 48, bias=False, seed=40), fresh_linear(64, 48, bias=False, seed=41)
    q = force_fast(QuantizedLinear.from_linear(lin, "fp8_row"))
    compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
    x = fresh(4, 64, seed=42)
    torch.testing.assert_close(compiled(x), q(x), rtol=1e-6, atol=1e-6)
    ptrs = (q.weight.data_ptr(), q.weight_scale.data_ptr())
    q.reload_(new.weight.detach().to(torch.bfloat16))
    assert (q.weight.data_ptr(), q.weight_scale.data_ptr()) == ptrs
    expected = QuantizedLinear.from_linear(new, "fp8_row")
    expected.reload_(new.weight.detach().to(torch.bfloat16))
    torch.testing.assert_close(compiled(x), expected(x), rtol=1e-5, atol=1e-6)  # no stale weights baked in


def test_paths_follow_device_moves_and_unknown_dtypes_emulate():
    q = QuantizedLinear.from_linear(fresh_linear(128, 32, bias=False, seed=50), "fp8_row")
    q._paths.clear()
    q.to("cpu")  # _apply re-selects
    assert q.gemm_path_for(1) == q.gemm_path_for(64) == "emulated"
    assert q._unit.device == q.weight.device and q._unit.dtype == torch.float32
    assert q.gemm_path_for(8, torch.float64) == "emulated"


def test_rollout_scheme_selectable_and_lm_head_embeddings_stay_high_precision():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    scheme = get_quant_scheme("fp8_row")
    assert isinstance(scheme, Fp8Row) and "lm_head" in scheme.skip_modules
    report = scheme.quantize_model(model)
    assert len(report.quantized) == 2 * 7
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in report.quantized)
    with pytest.raises(ValueError, match="allowed"):
        get_quant_scheme("fp8_rows")
    with pytest.raises(ValueError, match="allowed"):
        quantize_model(AutoModelForCausalLM.from_config(cfg), "fp8_rows")


EPILOGUE_SCRIPT = """
import torch
from lumenrl_quant.gemm import rowwise_epilogue, triton_rowwise_epilogue
gen = torch.Generator().manual_seed(0)
for m, n, bias in [(1, 48, False), (5, 300, True), (64, 512, False), (20, 256, True)]:
    acc = torch.randn(m, n, generator=gen)
    sa, sb = torch.rand(m, 1, generator=gen) + 0.1, torch.rand(n, 1, generator=gen) + 0.1
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    for dt in (torch.bfloat16, torch.float32):
        t = triton_rowwise_epilogue(acc, sa, sb, b, dt)
        r = rowwise_epilogue(acc.clone(), sa, sb, b, dt)
        assert t.dtype == dt and t.shape == (m, n)
        torch.testing.assert_close(t.float(), r.float(), rtol=2e-6 if dt == torch.float32 else 8e-3, atol=1e-6)
    one = sa[:1].reshape(())
    torch.testing.assert_close(triton_rowwise_epilogue(acc, one, sb, b, torch.float32),
                               rowwise_epilogue(acc.clone(), one, sb, b, torch.float32), rtol=2e-6, atol=1e-6)
print("ok")
"""


def test_triton_epilogue_matches_torch_under_interpreter():
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernel is decorated: fresh process
    out = subprocess.run([sys.executable, "-c", EPILOGUE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


def test_failing_fast_paths_fall_back_to_the_next_path(monkeypatch):
    monkeypatch.setattr(gemm, "_FAILED", set())
    monkeypatch.setattr(gemm, "_device_supports", lambda mode, device, k, out_dtype: True)
    calls = []

    def broken(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        raise RuntimeError("no kernel")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    aq, sa, bq, sb = rowwise_operands(4, 32, 64, seed=60)
    exact = dequantize_fp8(aq, sa).double() @ dequantize_fp8(bq, sb).double().t()
    with pytest.warns(UserWarning, match="falling back"):
        out = gemm.scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32)
    assert calls == [torch.float32, torch.float32]  # rowwise epilogue (fp32 acc), then the rowwise kernel
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    assert gemm_path(aq, sa, bq, sb, out_dtype=torch.float32) == "emulated"

    monkeypatch.setattr(gemm, "_FAILED", set())
    q = QuantizedLinear.from_linear(fresh_linear(64, 32, bias=False, seed=61), "fp8_row")
    assert q.gemm_path_for(4, torch.float32) == "scaled_mm_rowwise_epilogue"
    x = fresh(4, 64, seed=62)
    with pytest.warns(UserWarning, match="falling back"):
        y = q(x)
    assert q.gemm_path_for(4, torch.float32) == "emulated"
    assert sqnr_db(x.double() @ q.dequantized_weight().double().t(), y) >= 25.0


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm89+ CUDA GPU"
)


@needs_gpu
@pytest.mark.parametrize("m", [1, 8, 64, 300])
def test_gpu_fp8_row_paths_and_agreement(m):
    lin = fresh_linear(1024, 512, bias=False, seed=70).cuda().to(torch.bfloat16)
    q = QuantizedLinear.from_linear(lin, "fp8_row")
    expected = "scaled_mm_rowwise_epilogue" if m <= gemm.ROWWISE_EPILOGUE_MAX_M else "scaled_mm_rowwise"
    assert q.gemm_path_for(m) == expected
    x = fresh(m, 1024, seed=71).cuda().to(torch.bfloat16)
    y = q(x)
    a_q, a_s = quantize_fp8(x, dtype=q.fp8_dtype, granularity="rowwise", backend="torch")
    ref = run_gemm_path("emulated", a_q, a_s, q.weight, q.weight_scale, out_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and sqnr_db(ref, y) >= 40.0
    assert sqnr_db(x.double() @ lin.weight.double().t(), y) >= 25.0
    assert q.gemm_path_for(m) == expected  # the fast path ran (a failure would have moved it)


@needs_gpu
def test_gpu_fp8_row_cuda_graph_and_inductor_match_eager():
    torch._dynamo.reset()
    lin = fresh_linear(1024, 512, bias=True, seed=80)
    q = QuantizedLinear.from_linear(lin.cuda().to(torch.bfloat16), "fp8_row")
    block = NormThenLinear(q)
    block.norm = block.norm.cuda().to(torch.bfloat16)  # not block.to(): that would cast the FP8 buffers
    x = fresh(64, 1024, seed=81).cuda().to(torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(static)  # warm-up (Triton compiles) outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(static)
        static.copy_(fresh(64, 1024, seed=82).cuda().to(torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(captured, block(static), rtol=0, atol=0)
        compiled = torch.compile(block, fullgraph=True)(x)
        normed = block.norm(x).double()
    ref = normed @ lin.weight.double().t().cuda() + lin.bias.double().cuda()
    # Inductor divides by the activation scale as a reciprocal multiply, so a few codes round the other
    # way (H200: 38.5 dB between the two); both must meet the W8A8 bar against the float64 linear.
    assert sqnr_db(ref, eager.float()) >= 25.0 and sqnr_db(ref, compiled.float()) >= 25.0
    assert sqnr_db(eager.float(), compiled.float()) >= 30.0
