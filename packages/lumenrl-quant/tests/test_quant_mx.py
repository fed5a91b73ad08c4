"""MX formats: scales bit-exact vs a math.frexp reference, elements vs a nearest-value search,
FP4 pack/unpack exact, SQNR bars, NaN/zero/non-divisible handling."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_quant import mx
from lumenrl_quant.error import sqnr_db
from lumenrl_quant.mx import (
    MX_ELEM_FORMATS,
    dequantize_mx,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_float,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)


def fresh(*shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # log-normal magnitudes spread the block amaxes over many binades
    mag = torch.exp(torch.randn(*shape, generator=gen, dtype=torch.float64) * 2)
    sign = torch.where(torch.rand(*shape, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


def ref_scale_byte(block: list[float], emax: int) -> int:
    amax = max(abs(v) for v in block)
    if math.isnan(amax) or math.isinf(amax):
        return 255
    if amax == 0:
        return 0
    _, e = math.frexp(amax)  # amax = m * 2**e with m in [0.5, 1)
    return max(-127, min(127, (e - 1) - emax)) + 127


def grid(elem_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All finite values of the element format (float64) and their codes."""
    if elem_format == "e2m1":
        codes = torch.arange(16)
        return e2m1_decode(codes).double(), codes
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    vals = codes.view(MX_ELEM_FORMATS[elem_format].dtype).double()
    keep = torch.isfinite(vals)
    return vals[keep], codes[keep].long()


def ref_round(v: torch.Tensor, elem_format: str) -> torch.Tensor:
    """Saturate, then nearest representable value, ties to the even code (float64 search)."""
    vals, codes = grid(elem_format)
    vmax = MX_ELEM_FORMATS[elem_format].max
    v = v.double().clamp(-vmax, vmax).reshape(-1, 1)
    dist = (v - vals.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best
    # prefer even codes (mantissa LSB 0), and +0 over -0 for exact zeros
    penalty = (codes % 2).reshape(1, -1).double() * 2 + (vals.reshape(1, -1).signbit()).double()
    choice = torch.where(cand, penalty, torch.full_like(penalty, 1e9)).argmin(dim=1)
    return vals[choice].reshape(-1)


@pytest.mark.parametrize("elem_format", ["e4m3", "e5m2", "e2m1"])
def test_scales_bit_exact_and_elements_match_reference(elem_format):
    x = fresh(8, 96)
    x[0, :32] = 0.0  # zero block
    x[1, 5] = 1e-40  # a float32 subnormal inside a block
    x[1, 32:64] = torch.rand(32) * 1e-39  # block of subnormals only
    t = quantize_mx(x, elem_format)
    emax = MX_ELEM_FORMATS[elem_format].emax
    expected = [[ref_scale_byte(x[r, b * 32 : (b + 1) * 32].tolist(), emax) for b in range(3)] for r in range(8)]
    assert t.scale.dtype == torch.uint8
    assert t.scale.tolist() == expected
    xb = x.double().reshape(8, 3, 32)
    scale = torch.tensor(expected, dtype=torch.float64).sub(127).exp2().unsqueeze(-1)
    want = (ref_round((xb / scale).reshape(-1), elem_format).reshape(8, 3, 32) * scale).reshape(8, 96)
    assert torch.equal(dequantize_mx(t, dtype=torch.float64), want)


@pytest.mark.parametrize("elem_format,bar", [("e4m3", 18.0), ("e5m2", 18.0), ("e2m1", 12.0)])
def test_round_trip_sqnr(elem_format, bar):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(128, 512, generator=gen, dtype=torch.float64).float()
    assert sqnr_db(x, quantize_mx(x, elem_format).dequantize()) >= bar


def test_e2m1_rounding_is_nearest_even_and_saturates():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 6.0, 100.0, -0.75, -2.5])
    got = e2m1_decode(e2m1_encode(v.clamp(-6, 6)))
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, 6.0, -1.0, -2.0]


def test_fp4_pack_unpack_exact_and_low_nibble_first():
    codes = torch.randint(0, 16, (5, 7, 33), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, 7, 17) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed, 33), codes)
    assert pack_fp4(torch.tensor([0x1, 0x2, 0xF, 0x0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    with pytest.raises(ValueError, match="k=40"):
        unpack_fp4(packed, 40)


@pytest.mark.parametrize("elem_format", ["e4m3", "e2m1"])
def test_non_divisible_k_is_padded_and_shape_restored(elem_format):
    x = fresh(3, 4, 45)
    t = quantize_mx(x, elem_format)
    assert t.scale.shape == (3, 4, 2)
    assert t.data.shape == ((3, 4, 45) if elem_format == "e4m3" else (3, 4, 23))
    out = t.dequantize()
    assert out.shape == x.shape
    # the partial block's scale comes from its 13 real elements
    tail_amax = x[0, 0, 32:].abs().max().item()
    assert t.scale[0, 0, 1].item() == ref_scale_byte([tail_amax], MX_ELEM_FORMATS[elem_format].emax)


def test_nan_block_gets_nan_scale_other_blocks_unaffected():
    x = fresh(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    t = quantize_mx(x, "e4m3")
    assert t.scale[0, 0].item() == 255 and t.scale[1, 1].item() == 255
    out = t.dequantize()
    assert torch.isnan(out[0, :32]).all() and torch.isnan(out[1, 32:]).all()
    assert torch.isfinite(out[0, 32:]).all() and torch.isfinite(out[1, :32]).all()
    assert math.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


def test_bad_elem_format_names_allowed_values():
    with pytest.raises(ValueError, match="e2m1"):
        quantize_mx(torch.ones(32), "fp6")
    assert mx.MX_BLOCK_SIZE == 32
