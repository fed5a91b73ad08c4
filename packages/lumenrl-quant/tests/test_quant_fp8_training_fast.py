"""Tensorwise FP8 training fast path: fused quantize+transpose, saved FP8 operands, compile, cache."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest
import torch
from torch import nn

from lumenrl_quant.error import sqnr_db
from lumenrl_quant.fp8 import quantize_fp8
from lumenrl_quant.training import (
    Fp8TrainingConfig,
    Fp8TrainingLinear,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
)
from lumenrl_quant.triton_training import (
    quantize_with_transpose,
    quantize_with_transpose_torch,
    set_compiled_backend,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small GEMMs, a shared CPU


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------- quantize + transpose


@pytest.mark.parametrize("dtype", [E4, E5, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_torch_quantize_with_transpose_equals_quantize_fp8(dtype, src):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(67, 48, generator=g) * 5).to(src)
    q, qt, scale = quantize_with_transpose_torch(x, dtype)
    rq, rs = quantize_fp8(x, dtype=dtype, granularity="tensorwise", backend="torch")
    assert torch.equal(scale, rs) and scale.dtype == torch.float32 and scale.dim() == 0
    assert torch.equal(_bits(q), _bits(rq)) and qt.is_contiguous() and qt.shape == (48, 67)
    assert torch.equal(_bits(qt), _bits(rq.t().contiguous()))
    zq, zqt, zs = quantize_with_transpose(torch.zeros(16, 32, dtype=src), dtype)  # all-zero: scale 1
    assert zs.item() == 1.0 and not zq.float().any() and zqt.shape == (32, 16)
    eq, eqt, es = quantize_with_transpose(torch.zeros(0, 32, dtype=src), dtype)  # empty: unit scale
    assert es.item() == 1.0 and eq.shape == (0, 32) and eqt.shape == (32, 0)


_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import torch
    from lumenrl_quant import triton_training as tt
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for m, k, transpose_input in ((200, 136, False), (64, 256, True), (1, 16, False)):
            # FP8-representable data times a power of two: the kernel's scale, division, saturation,
            # masking and both layouts must match torch bit for bit (the interpreter's own FP8 cast
            # drops mantissa carries, so inputs that need rounding are checked on the GPU instead)
            byte = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
            q0 = byte.view(dtype).float()
            q0 = torch.where(torch.isfinite(q0), q0, torch.zeros_like(q0))
            q0[0, 0] = -torch.finfo(dtype).max
            x = (q0 * 2.0**-3).to(torch.bfloat16)
            if transpose_input:
                x = x.t().contiguous().t()  # column-major input: strided loads
            q, qt, s = tt.fp8_quantize_with_transpose_triton(x, dtype)
            rq, rqt, rs = tt.quantize_with_transpose_torch(x, dtype)
            assert torch.equal(s, rs), (s, rs)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (dtype, m, k)
            assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)), (dtype, m, k)
            assert qt.shape == (k, m) and qt.is_contiguous()
    print("INTERPRET_OK")
    """
)


@pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed")
def test_fused_triton_kernel_under_interpreter_is_bit_identical_to_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "INTERPRET_OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or find_spec("triton") is None, reason="needs CUDA + triton")
@pytest.mark.parametrize("dtype", [E4, E5])
def test_fused_triton_kernel_on_gpu_is_bit_identical_to_torch(dtype):
    from lumenrl_quant.triton_training import fp8_quantize_with_transpose_triton

    x = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16) * 7
    q, qt, s = fp8_quantize_with_transpose_triton(x, dtype)
    rq, rqt, rs = quantize_with_transpose_torch(x, dtype)
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(qt), _bits(rqt))


# ---------------------------------------------------------------- numerics of the linear


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("seed", [3, 4])
def test_tensorwise_forward_and_grads_vs_float64(fmt, seed):
    g = torch.Generator().manual_seed(seed)
    k, n, tokens = 192, 320, (5, 37)  # 185 tokens: exercises the zero-padding to 16
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    x = torch.randn(*tokens, k, generator=g, dtype=torch.float64)
    grad = torch.randn(*tokens, n, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    (xr @ wr.t() + br).backward(grad)
    layer = Fp8TrainingLinear(k, n, config=Fp8TrainingConfig(recipe="tensorwise", fp8_format=fmt))
    layer.load_state_dict({"weight": w.float(), "bias": b.float()})
    xf = x.float().requires_grad_(True)
    y = layer(xf)
    y.backward(grad.float())
    y_ref = (x @ w.t() + b)
    assert y.shape == (*tokens, n) and y.dtype == torch.float32
    assert 18.0 <= sqnr_db(y_ref, y.detach()) < 60.0  # FP8 accuracy, and really FP8
    assert sqnr_db(xr.grad, xf.grad) >= (17.0 if fmt == "hybrid" else 20.0)
    assert sqnr_db(wr.grad, layer.weight.grad) >= (17.0 if fmt == "hybrid" else 20.0)
    torch.testing.assert_close(layer.bias.grad.double(), br.grad, rtol=1e-5, atol=1e-4)


def test_backward_saves_fp8_operands_not_the_high_precision_input():
    layer = Fp8TrainingLinear(128, 64, bias=False, dtype=torch.bfloat16)
    x = torch.randn(48, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    assert (E4, (128, 48)) in saved  # x_q^T for wgrad
    assert (E4, (128, 64)) in saved  # W_q^T for dgrad
    assert all(dtype != torch.bfloat16 for dtype, _ in saved), saved


# ---------------------------------------------------------------- torch.compile


class _Block(nn.Module):
    """Decoder-layer-shaped: norm, gated MLP (3 linears) and a residual."""

    def __init__(self, d: int = 64, h: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _train(model: nn.Module, steps: int, x: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    attach_weight_cache_invalidation(opt, model)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("quant_backend", ["inductor", "triton"])
def test_compiled_fp8_layer_compiles_once_without_graph_breaks(quant_backend):
    from torch._dynamo.utils import counters

    torch.manual_seed(9)
    eager = nn.Sequential(_Block(), _Block())
    compiled = nn.Sequential(_Block(), _Block())
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        assert len(convert_to_fp8_training(model, recipe="tensorwise").converted) == 6
    torch._dynamo.reset()
    counters.clear()
    set_compiled_backend(quant_backend)
    try:
        for block in compiled:
            block.compile(backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
        x = torch.randn(3, 20, 64, requires_grad=True)  # 60 tokens: padded inside the graph
        with torch._dynamo.config.patch(error_on_recompile=True):
            losses_c = _train(compiled, 3, x)
    finally:
        set_compiled_backend("inductor")
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1  # both blocks share one graph, all 3 steps
    assert not counters["graph_break"]
    losses_e = _train(eager, 3, x)
    assert losses_c[2] < losses_c[0]
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_e), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_other_recipes_run_compiled_and_match_eager(recipe):
    torch.manual_seed(10)
    eager = nn.Sequential(_Block(128, 256))
    compiled = nn.Sequential(_Block(128, 256))
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        convert_to_fp8_training(model, recipe=recipe)
    torch._dynamo.reset()
    try:
        compiled[0].compile(backend="aot_eager")
        x = torch.randn(2, 64, 128, requires_grad=True)
        losses_c = _train(compiled, 2, x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(_train(eager, 2, x)), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- weight cache


def test_tensorwise_cache_holds_both_layouts_once_per_step_and_is_invalidated():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    convert_to_fp8_training(model, recipe="tensorwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    attach_weight_cache_invalidation(opt, model)
    layer = model[2]
    x = torch.randn(32, 64)
    for _ in range(3):  # three micro-batches, one step: W quantized once (both layouts)
        model(x).square().mean().backward()
    assert layer.weight_cache.quantizations == 2 and len(layer.weight_cache) == 2
    fwd = layer.weight_cache.get("forward", layer.weight, lambda: pytest.fail("cache miss"))
    dgrad = layer.weight_cache.get("dgrad", layer.weight, lambda: pytest.fail("cache miss"))
    assert torch.equal(_bits(dgrad.q), _bits(fwd.q.t().contiguous())) and dgrad.qt is fwd.q
    old = fwd.q.clone()
    opt.step()
    assert len(layer.weight_cache) == 0  # the step hook dropped it
    model(x)
    new = layer.weight_cache.get("forward", layer.weight, lambda: pytest.fail("cache miss"))
    rq, rs = quantize_fp8(layer.weight.detach(), granularity="tensorwise", backend="torch")
    assert torch.equal(_bits(new.q), _bits(rq)) and torch.equal(new.scale, rs)
    assert not torch.equal(_bits(new.q), _bits(old))


# ---------------------------------------------------------------- GPU (skipped on CPU)

_HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (sm89+)")
@pytest.mark.parametrize("quant_backend", ["inductor", "triton"])
def test_gpu_inductor_compiled_block_matches_eager_without_recompiles(quant_backend):
    from torch._dynamo.utils import counters

    torch.manual_seed(12)
    eager = nn.Sequential(_Block(256, 512), _Block(256, 512)).cuda().to(torch.bfloat16)
    compiled = nn.Sequential(_Block(256, 512), _Block(256, 512)).cuda().to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        convert_to_fp8_training(model, recipe="tensorwise")
    assert eager[0].up._fp8_fast_gemm  # torch._scaled_mm, not the emulation
    torch._dynamo.reset()
    counters.clear()
    set_compiled_backend(quant_backend)
    try:
        for block in compiled:
            block.compile(fullgraph=True)
        x = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            losses_c = _train(compiled, 3, x)
    finally:
        set_compiled_backend("inductor")
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    losses_e = _train(eager, 3, x)
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_e), rtol=2e-2, atol=1e-4)
