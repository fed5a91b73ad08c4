"""FP8 training linear: numerics vs float64, exact recipe semantics, weight cache, conversion."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lumenrl_quant.error import sqnr_db
from lumenrl_quant.fp8 import dequantize_fp8, quantize_fp8
from lumenrl_quant.training import (
    Fp8TrainingConfig,
    Fp8TrainingLinear,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
    invalidate_fp8_weight_caches,
)

RECIPES = ["tensorwise", "rowwise", "blockwise"]
FORMATS = ["e4m3", "hybrid"]


pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small GEMMs, a shared CPU


def reference_and_fp8(recipe: str, fmt: str, seed: int, tokens=(3, 67), k=256, n=384):
    """Run one float64 nn.Linear and its FP8 float32 twin on the same random data."""
    g = torch.Generator().manual_seed(seed)
    ref = nn.Linear(k, n, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k))
        ref.bias.copy_(torch.randn(n, generator=g, dtype=torch.float64))
    x = torch.randn(*tokens, k, generator=g, dtype=torch.float64).requires_grad_(True)
    grad = torch.randn(*tokens, n, generator=g, dtype=torch.float64)
    y = ref(x)
    y.backward(grad)
    model = nn.Sequential(nn.Linear(k, n))
    model[0].load_state_dict({key: v.float() for key, v in ref.state_dict().items()})
    report = convert_to_fp8_training(model, recipe=recipe, fp8_format=fmt)
    assert report.converted == ["0"]
    xf = x.detach().float().requires_grad_(True)
    yf = model(xf)
    yf.backward(grad.float())
    return (y, x.grad, ref.weight.grad, ref.bias.grad), (
        yf,
        xf.grad,
        model[0].weight.grad,
        model[0].bias.grad,
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_and_grads_meet_sqnr_bars(recipe, fmt, seed):
    (y, dx, dw, db), (yf, dxf, dwf, dbf) = reference_and_fp8(recipe, fmt, seed)
    assert yf.shape == y.shape and yf.dtype == torch.float32
    assert sqnr_db(y, yf) >= 18.0
    assert sqnr_db(dx, dxf) >= 17.0
    assert sqnr_db(dw, dwf) >= 17.0
    torch.testing.assert_close(dbf.double(), db, rtol=1e-5, atol=1e-4)  # bias grad is not quantized
    assert sqnr_db(y, yf) < 60.0  # the GEMM really ran in FP8


def test_fnuz_formats_can_be_forced_and_meet_the_bars():
    torch.manual_seed(8)
    ref = nn.Linear(256, 128, dtype=torch.float64)
    x = torch.randn(64, 256, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(256, 128))
    model[0].load_state_dict({key: v.float() for key, v in ref.state_dict().items()})
    convert_to_fp8_training(model, recipe="rowwise", fp8_format="hybrid", fnuz=True)
    recipe = model[0]._recipe()
    assert (recipe.forward_dtype, recipe.grad_dtype) == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    assert sqnr_db(ref(x).detach(), model(x.float()).detach()) >= 18.0


def _dq(t: torch.Tensor, dtype: torch.dtype, granularity: str, block=None) -> torch.Tensor:
    q, s = quantize_fp8(t, dtype=dtype, granularity=granularity, block_size=block)
    return dequantize_fp8(q, s, block_size=block)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemms_equal_the_recipe_definition_exactly(recipe):
    """Forward, dgrad and wgrad equal dequantize(quantize(operand)) matmuls built independently."""
    torch.manual_seed(3)
    k, n, m = 256, 128, 128
    layer = Fp8TrainingLinear(k, n, bias=False, config=Fp8TrainingConfig(recipe=recipe, fp8_format="hybrid"))
    x = torch.randn(m, k, requires_grad=True)
    grad = torch.randn(m, n)
    y = layer(x)
    y.backward(grad)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    gran = "block" if recipe == "blockwise" else recipe
    a_blk, b_blk = ((1, 128), (128, 128)) if recipe == "blockwise" else (None, None)
    w = layer.weight.detach()
    w_fwd = _dq(w, e4, gran, b_blk)
    w_dgrad = w_fwd if recipe != "rowwise" else _dq(w.t(), e4, gran, b_blk).t()
    torch.testing.assert_close(y, _dq(x.detach(), e4, gran, a_blk) @ w_fwd.t(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad, _dq(grad, e5, gran, a_blk) @ w_dgrad, rtol=1e-6, atol=1e-5)
    expected_dw = _dq(grad.t(), e5, gran, a_blk) @ _dq(x.detach().t(), e4, gran, b_blk).t()
    torch.testing.assert_close(layer.weight.grad, expected_dw, rtol=1e-6, atol=1e-4)


def test_e4m3_format_quantizes_gradients_to_e4m3():
    torch.manual_seed(4)
    layer = Fp8TrainingLinear(128, 64, bias=False, config=Fp8TrainingConfig(fp8_format="e4m3"))
    x = torch.randn(32, 128, requires_grad=True)
    grad = torch.randn(32, 64)
    layer(x).backward(grad)
    w = _dq(layer.weight.detach(), torch.float8_e4m3fn, "tensorwise")
    torch.testing.assert_close(x.grad, _dq(grad, torch.float8_e4m3fn, "tensorwise") @ w, rtol=1e-6, atol=1e-5)


def test_master_weights_keep_their_dtype_and_low_precision_inputs_work():
    layer = Fp8TrainingLinear(128, 128, config=Fp8TrainingConfig(recipe="rowwise"))
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 128)
    assert layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- weight cache


def _two_layer(recipe="blockwise") -> nn.Sequential:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    convert_to_fp8_training(model, recipe=recipe)
    return model


def test_weight_cache_is_reused_within_a_step_and_refreshed_after_it():
    model = _two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    attach_weight_cache_invalidation(opt, model)
    layer = model[0]
    x = torch.randn(4, 16, 128, requires_grad=True)  # so layer 0 runs dgrad too
    outs = []
    for _ in range(3):  # three micro-batches, one optimizer step
        out = model(x)
        out.square().mean().backward()
        outs.append(out.detach())
    assert layer.weight_cache.quantizations == 2  # forward W + dgrad W^T, once each
    assert torch.equal(outs[0], outs[2])
    opt.step()
    assert len(layer.weight_cache) == 0  # dropped by the step hook
    after = model(x)
    assert layer.weight_cache.quantizations == 3
    fresh = Fp8TrainingLinear(128, 256, config=Fp8TrainingConfig(recipe="blockwise", weight_cache=False))
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x), fresh(x), rtol=0, atol=0)  # cache holds the new weight
    assert not torch.equal(after, outs[0])


def test_hook_is_needed_for_updates_through_data_and_can_be_removed():
    model = _two_layer("tensorwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach_weight_cache_invalidation(opt, model)
    x = torch.randn(8, 128)
    model(x)
    layer = model[0]
    with torch.no_grad():
        layer.weight.data.mul_(2.0)  # bypasses the version counter: the cache cannot see it
    stale = layer(x)
    assert invalidate_fp8_weight_caches(model) == 2
    refreshed = layer(x)
    assert not torch.equal(stale, refreshed)
    handle.remove()
    model(x).sum().backward()
    opt.step()
    assert len(model[2].weight_cache) == 2  # no hook: entries stay until a forward checks them


def test_in_place_weight_updates_are_never_served_stale():
    model = _two_layer("rowwise")
    layer = model[0]
    x = torch.randn(8, 128)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # bumps the autograd version counter
    torch.testing.assert_close(layer(x) - layer.bias, -(before - layer.bias), rtol=1e-5, atol=1e-5)


def test_disabled_cache_quantizes_every_call():
    layer = Fp8TrainingLinear(128, 128, config=Fp8TrainingConfig(weight_cache=False))
    assert layer.weight_cache is None
    x = torch.randn(4, 128)
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)


# ---------------------------------------------------------------- conversion


class _MyLinear(nn.Linear):
    pass


def test_conversion_report_names_every_skip_and_reason():
    torch.manual_seed(6)
    shared = nn.Linear(128, 128)
    model = nn.ModuleDict(
        {
            "up": nn.Linear(128, 256),
            "odd": nn.Linear(128, 100),
            "small": nn.Linear(128, 16),
            "head": nn.Linear(256, 128),
            "custom": _MyLinear(128, 128),
            "a": shared,
            "b": shared,
        }
    )
    params_before = {id(p) for p in model.parameters()}
    report = convert_to_fp8_training(
        model, recipe="tensorwise", min_features=32, module_filter=lambda fqn, m: fqn != "head"
    )
    assert sorted(report.converted) == ["a", "b", "up"]
    assert set(report.skipped) == {"odd", "small", "head", "custom"}
    assert "multiples of 16" in report.skipped["odd"] and "100" in report.skipped["odd"]
    assert "min_features=32" in report.skipped["small"]
    assert "module_filter" in report.skipped["head"]
    assert "_MyLinear" in report.skipped["custom"]
    assert model["a"] is model["b"] and isinstance(model["a"], Fp8TrainingLinear)
    assert {id(p) for p in model.parameters()} == params_before  # same Parameter objects
    assert "skipped odd" in str(report)
    again = convert_to_fp8_training(model, recipe="tensorwise", min_features=32)
    assert again.converted == ["head"] and "already" in again.skipped["up"]


def test_blockwise_needs_whole_128_blocks():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 144))
    report = convert_to_fp8_training(model, recipe="blockwise")
    assert report.converted == ["0"] and "multiples of 128" in report.skipped["1"]


@pytest.mark.parametrize(
    ("kwargs", "needle"), [({"recipe": "tilewise"}, "recipe"), ({"fp8_format": "e5m2"}, "fp8_format")]
)
def test_bad_settings_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        convert_to_fp8_training(nn.Sequential(nn.Linear(16, 16)), **kwargs)


# ---------------------------------------------------------------- convergence (the must-show)

D_IN, D_HIDDEN, BATCH, STEPS, NOISE = 128, 256, 64, 300, 0.2


def _regression_data():
    """A fixed random tanh teacher plus Gaussian noise; 300 training batches and a held-out set."""
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(D_IN, D_HIDDEN, generator=g) / math.sqrt(D_IN)
    w2 = torch.randn(D_HIDDEN, D_IN, generator=g) / math.sqrt(D_HIDDEN)

    def sample(n):
        x = torch.randn(n, D_IN, generator=g)
        return x, torch.tanh(x @ w1) @ w2 + NOISE * torch.randn(n, D_IN, generator=g)

    return sample(STEPS * BATCH), sample(2048)


def _train_mlp(recipe: str | None, fmt: str = "hybrid") -> tuple[float, float]:
    """Train a 2-layer MLP for 300 AdamW steps; returns (first-batch loss, held-out loss)."""
    (x, y), (x_eval, y_eval) = _regression_data()
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_IN))
    if recipe is not None:
        assert convert_to_fp8_training(model, recipe=recipe, fp8_format=fmt).converted == ["0", "2"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    attach_weight_cache_invalidation(opt, model)
    first = None
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # evaluated as trained: the FP8 model runs its FP8 forward
        return first, nn.functional.mse_loss(model(x_eval), y_eval).item()


@pytest.fixture(scope="module")
def fp32_run() -> tuple[float, float]:
    return _train_mlp(None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_training_matches_fp32_loss_within_2_percent(fp32_run, recipe, fmt):
    first, final = _train_mlp(recipe, fmt)
    first32, final32 = fp32_run
    assert final < 0.5 * first  # it learned (the noise floor is NOISE**2 = 0.04)
    assert abs(final - final32) / final32 <= 0.02, (final, final32)
    assert final != final32  # and really ran through FP8


# ---------------------------------------------------------------- GPU path vs CPU emulation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_scaled_gemms_agree_with_cpu_emulation(recipe):
    """Same bf16 inputs and upstream gradient: only the GEMM path (and accumulation) differs."""
    torch.manual_seed(7)
    config = Fp8TrainingConfig(recipe=recipe, fp8_format="hybrid")
    cpu = Fp8TrainingLinear(256, 512, dtype=torch.bfloat16, config=config)
    gpu = Fp8TrainingLinear(256, 512, dtype=torch.bfloat16, device="cuda", config=config)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(384, 256, dtype=torch.bfloat16)
    grad = torch.randn(384, 512, dtype=torch.bfloat16)
    xc, xg = x.clone().requires_grad_(True), x.cuda().requires_grad_(True)
    yc, yg = cpu(xc), gpu(xg)
    yc.backward(grad)
    yg.backward(grad.cuda())
    assert sqnr_db(yc.detach(), yg.detach().cpu()) >= 35.0
    assert sqnr_db(xc.grad, xg.grad.cpu()) >= 35.0
    assert sqnr_db(cpu.weight.grad, gpu.weight.grad.cpu()) >= 35.0
