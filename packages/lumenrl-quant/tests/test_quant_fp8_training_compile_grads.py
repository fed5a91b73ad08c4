"""Compiled FP8 training linears: weight gradients (not only losses) equal eager, on every path.

The H200 run (torch 2.11) found ``torch.compile``d FP8 linears with all-zero gradients while the
loss was right: torch 2.11's dynamo returns the intermediates of a traced ``autograd.Function``
forward as extra subgraph outputs without dropping aliases (pytorch#180642, fixed in 2.12 by
``filter_aliased_intermediates``). An identity ``out.to(out_dtype)`` (the GEMM already wrote
``out_dtype``: bf16 ``_scaled_mm`` output in a bf16 model, float32 emulation in a float32 one)
makes the returned tensor such an alias; autograd then re-numbers the output and its gradient
never reaches backward. The fixture below puts torch 2.13's dynamo in that 2.11 mode (the
intermediates are collected and not filtered) so CPU runs catch the pattern; the GPU-only
``torch._scaled_mm`` branch is forced on CPU (torch's CPU ``_scaled_mm``: slow, small shapes).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from lumenrl_quant.error import sqnr_db
from lumenrl_quant.training import Fp8TrainingLinear, convert_to_fp8_training

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small GEMMs, a shared CPU


@pytest.fixture
def torch211_tracing(monkeypatch):
    """Trace ``autograd.Function`` forwards as torch 2.11 does: intermediates become unfiltered outputs."""
    hoo = pytest.importorskip("torch._dynamo.variables.higher_order_ops")
    side_effects = pytest.importorskip("torch._dynamo.side_effects")
    from torch._dynamo.variables.misc import AutogradFunctionContextVariable

    collect = getattr(hoo, "collect_intermediate_outputs", None)
    check = getattr(side_effects.SideEffects, "check_allowed_side_effect", None)
    if (collect is None or check is None
            or "filter_aliased_intermediates" not in inspect.signature(collect).parameters
            or not hasattr(side_effects.SideEffects, "should_allow_side_effects_in_hop")):
        pytest.skip("this torch's dynamo internals differ from 2.13's: cannot put it in 2.11 mode")

    def collect_unfiltered(tx, subtracer, outputs, filter_aliased_intermediates=False):
        return collect(tx, subtracer, outputs, False)

    def ctx_store_is_a_side_effect(self, item):  # makes every forward (they all set ctx.*) collect
        if isinstance(item, AutogradFunctionContextVariable) and self.should_allow_side_effects_in_hop():
            tracer = self.output_graph_weakref().current_tx.output.current_tracer
            if tracer.side_effect_stack is None:
                tracer.side_effect_stack = torch._guards.TracingContext.extract_stack()
            return True
        return check(self, item)

    monkeypatch.setattr(hoo, "collect_intermediate_outputs", collect_unfiltered)
    monkeypatch.setattr(side_effects.SideEffects, "check_allowed_side_effect", ctx_store_is_a_side_effect)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    xx = x.clone().requires_grad_()
    loss = model(xx).float().square().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, xx.grad.float()


def _compiled_vs_eager(recipe: str, dtype: torch.dtype, tokens: int, fast: bool, d: int = 128, h: int = 256):
    torch.manual_seed(21)
    eager, compiled = _Block(d, h).to(dtype), _Block(d, h).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        assert len(convert_to_fp8_training(model, recipe=recipe).converted) == 3
        for layer in model.modules():
            if isinstance(layer, Fp8TrainingLinear) and fast:
                layer._fp8_fast_gemm = True  # the GPU branch: torch._scaled_mm (its CPU kernel here)
    torch._dynamo.reset()
    compiled.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(1, tokens, d, dtype=dtype)
    try:
        return _grads(eager, x), _grads(compiled, x)
    finally:
        torch._dynamo.reset()


def _assert_same_grads(eager, compiled) -> None:
    (loss_e, grads_e, dx_e), (loss_c, grads_c, dx_c) = eager, compiled
    assert loss_c == pytest.approx(loss_e, rel=1e-5)
    for name, g in grads_e.items():
        assert g.abs().max() > 0, name
        assert sqnr_db(g, grads_c[name]) > 40.0, (name, sqnr_db(g, grads_c[name]))
    assert sqnr_db(dx_e, dx_c) > 40.0


_HAS_CPU_SCALED_MM = hasattr(torch, "_scaled_mm")


@pytest.mark.skipif(not _HAS_CPU_SCALED_MM, reason="needs torch._scaled_mm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [32, 40])  # 40: the token dim is padded to 48 inside the function
def test_tensorwise_scaled_mm_branch_compiled_grads_match_eager_under_torch211_tracing(
    torch211_tracing, dtype, tokens
):
    eager, compiled = _compiled_vs_eager("tensorwise", dtype, tokens, fast=True, d=64, h=128)
    _assert_same_grads(eager, compiled)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_emulated_gemm_compiled_grads_match_eager_under_torch211_tracing(torch211_tracing, recipe):
    _assert_same_grads(*_compiled_vs_eager(recipe, torch.float32, 64, fast=False))


def test_compiled_grads_match_eager_with_this_torchs_own_tracing():
    _assert_same_grads(*_compiled_vs_eager("tensorwise", torch.float32, 64, fast=False))


class _IdentityCastLinear(torch.autograd.Function):
    """The pattern that broke: the GEMM writes the output dtype, then an identity ``to``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.note = "ctx attribute"
        return (x @ w.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_the_torch211_mode_reproduces_zero_gradients_of_an_aliased_output(torch211_tracing):
    """Guards the fixture: if it stops emulating 2.11, the tests above would pass vacuously."""
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 16)
    _IdentityCastLinear.apply(x, w).square().sum().backward()
    expected, w.grad = w.grad.clone(), None
    compiled = torch.compile(lambda a, b: _IdentityCastLinear.apply(a, b).square().sum(), backend="aot_eager")
    compiled(x, w).backward()
    assert expected.abs().max() > 0
    assert w.grad is None or torch.count_nonzero(w.grad) == 0  # the torch 2.11 bug, reproduced on CPU


_HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (sm89+)")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_gpu_compiled_grads_match_eager(recipe, backend):
    """The H200 failure itself: bf16 model, 384 tokens (no padding), cuBLAS FP8 GEMMs."""
    torch.manual_seed(22)
    eager = _Block(256, 512).cuda().to(torch.bfloat16)
    compiled = _Block(256, 512).cuda().to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        convert_to_fp8_training(model, recipe=recipe)
    assert recipe != "tensorwise" or eager.up._fp8_fast_gemm
    torch._dynamo.reset()
    compiled.compile(backend=backend, fullgraph=True)
    x = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
    try:
        (loss_e, grads_e, dx_e), (loss_c, grads_c, dx_c) = _grads(eager, x), _grads(compiled, x)
    finally:
        torch._dynamo.reset()
    assert loss_c == pytest.approx(loss_e, rel=2e-2)
    sqnr = {name: float(sqnr_db(g, grads_c[name])) for name, g in grads_e.items()}
    sqnr["x"] = float(sqnr_db(dx_e, dx_c))
    floor = 30.0 if backend == "aot_eager" else 15.0  # inductor re-fuses the bf16 norm / SiLU
    assert all(v > floor for v in sqnr.values()), sqnr  # the bug: 0 dB (all-zero gradients)
