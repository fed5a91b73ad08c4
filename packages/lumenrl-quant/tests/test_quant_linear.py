"""QuantizedLinear: SQNR vs float64, in-place reload (same storage), shapes and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lumenrl_quant import LINEAR_SCHEMES, QuantizedLinear
from lumenrl_quant.error import sqnr_db

BARS = {"fp8_block": 18.0, "fp8_row": 18.0, "fp8_tensor": 18.0, "fp8_w8a16": 25.0, "mxfp8": 25.0, "mxfp4": 12.0}


def fresh_linear(k: int, n: int, *, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # trained-weight-like gaussian init (HF initializer_range 0.02)
        lin.weight.normal_(0.0, 0.02)
        if bias:
            lin.bias.normal_(0.0, 0.02)
    return lin


def reference(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ lin.weight.double().t()
    return out + lin.bias.double() if lin.bias is not None else out


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
def test_output_sqnr_vs_float64(scheme):
    lin = fresh_linear(512, 384)
    x = torch.randn(3, 21, 512)
    q = QuantizedLinear.from_linear(lin, scheme)
    y = q(x)
    assert y.shape == (3, 21, 384) and y.dtype == x.dtype
    assert sqnr_db(reference(lin, x), y) >= BARS[scheme]


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
def test_reload_requantizes_in_place_without_reallocation(scheme):
    lin = fresh_linear(256, 128)
    q = QuantizedLinear.from_linear(lin, scheme)
    ptrs = (q.weight.data_ptr(), q.weight_scale.data_ptr())
    old = q.weight.clone()
    new_lin = fresh_linear(256, 128)
    q.reload_(new_lin.weight.detach().to(torch.bfloat16))
    assert (q.weight.data_ptr(), q.weight_scale.data_ptr()) == ptrs
    assert not torch.equal(q.weight.view(torch.uint8), old.view(torch.uint8))
    expected = QuantizedLinear.from_linear(new_lin, scheme)
    expected.reload_(new_lin.weight.detach().to(torch.bfloat16))
    assert torch.equal(q.weight.view(torch.uint8), expected.weight.view(torch.uint8))
    assert torch.equal(q.weight_scale, expected.weight_scale)
    with pytest.raises(ValueError, match="does not match"):
        q.reload_(torch.randn(128, 255))


@pytest.mark.parametrize("scheme", ["fp8_block", "mxfp8", "mxfp4"])
def test_non_divisible_features(scheme):
    lin = fresh_linear(200, 72)  # K, N not multiples of 128 (nor of 32 for K)
    x = torch.randn(5, 200)
    y = QuantizedLinear.from_linear(lin, scheme)(x)
    assert y.shape == (5, 72)
    assert sqnr_db(reference(lin, x), y) >= BARS[scheme]


def test_bias_free_bf16_input_and_empty_batch():
    lin = fresh_linear(256, 128, bias=False)
    q = QuantizedLinear.from_linear(lin, "fp8_block")
    assert q.bias is None
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16
    assert sqnr_db(reference(lin, x.float()), y.float()) >= 18.0
    assert q(torch.randn(0, 256)).shape == (0, 128)


def test_weight_bytes_shrink_and_state_dict_names_kept():
    lin = fresh_linear(256, 128)
    fp8 = QuantizedLinear.from_linear(lin, "fp8_block")
    fp4 = QuantizedLinear.from_linear(lin, "mxfp4")
    assert fp8.weight.element_size() == 1 and fp4.weight.shape == (128, 128)
    assert set(fp8.state_dict()) == {"weight", "weight_scale", "bias"}


def test_dequantized_weight_matches_reference():
    lin = fresh_linear(256, 256)
    q = QuantizedLinear.from_linear(lin, "fp8_row")
    assert sqnr_db(lin.weight, q.dequantized_weight()) >= 25.0


def test_unknown_scheme_lists_allowed():
    with pytest.raises(ValueError, match="fp8_block"):
        QuantizedLinear.from_linear(nn.Linear(32, 32), "int4")


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4"])
def test_mx_schemes_refuse_an_fp8_dtype(scheme):
    lin = fresh_linear(64, 32)
    with pytest.raises(ValueError, match=rf"^fp8_dtype=torch\.float8_e4m3fn has no effect with scheme='{scheme}'"):
        QuantizedLinear.from_linear(lin, scheme, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype=torch.float8_e5m2"):
        QuantizedLinear(64, 32, scheme=scheme, fp8_dtype=torch.float8_e5m2)
    q = QuantizedLinear.from_linear(lin, scheme, fp8_dtype=None)  # unset: the MX layer has no FP8 dtype
    x = torch.randn(5, 64)
    assert q.fp8_dtype is None and sqnr_db(reference(lin, x), q(x)) >= BARS[scheme]
    fp8 = QuantizedLinear.from_linear(lin, "fp8_row", fp8_dtype=torch.float8_e5m2)  # FP8 schemes read it
    assert fp8.fp8_dtype == fp8.weight.dtype == torch.float8_e5m2


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
def test_bf16_activations_with_fp32_bias(scheme):
    lin = fresh_linear(256, 64)
    q = QuantizedLinear.from_linear(lin, scheme)
    x = torch.randn(3, 256)
    y = q(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert sqnr_db(reference(lin, x), y.float()) >= BARS[scheme] - 3.0  # bf16 input rounding costs a little


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
def test_constructor_weight_matches_reload(scheme):
    w = fresh_linear(256, 64).weight.detach()
    built = QuantizedLinear(256, 64, scheme=scheme, weight=w)
    reloaded = QuantizedLinear(256, 64, scheme=scheme).reload_(w)
    assert torch.equal(built.weight.view(torch.uint8), reloaded.weight.view(torch.uint8))
    assert torch.equal(built.weight_scale, reloaded.weight_scale)
    with pytest.raises(ValueError, match=r"\(64, 256\)"):
        QuantizedLinear(256, 64, scheme=scheme, weight=w.t())
