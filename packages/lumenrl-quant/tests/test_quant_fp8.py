"""FP8 formats, quantize/dequantize and scaled_mm against float64 references."""

from __future__ import annotations

import pytest
import torch

from lumenrl_quant import (
    E4M3,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    dequantize_fp8,
    emulated_scaled_mm,
    fp8_dtypes_for,
    fp8_format,
    fp8_max,
    gemm_path,
    quantize_fp8,
    quantize_fp8_with_scale,
    scaled_mm,
)
from lumenrl_quant.error import sqnr_db
from lumenrl_quant.fp8 import round_scale_to_power_of_two
from lumenrl_quant.gemm import _torch_scaled_mm

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
GRANULARITIES = [("tensorwise", None), ("rowwise", None), ("block", (1, 128)), ("block", (128, 128))]


def fresh(*shape: int, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).float()


def test_format_table():
    assert [f.max for f in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ)] == [448.0, 57344.0, 240.0, 57344.0]
    for f in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ):
        assert torch.finfo(f.dtype).max == f.max
        assert fp8_format(f.dtype) is f and fp8_format(f.name) is f
    assert fp8_format("float8_e4m3fn") is E4M3
    with pytest.raises(ValueError, match="e4m3"):
        fp8_format("e3m4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8_max(torch.bfloat16)


def test_fp8_dtypes_for_picks_ocp_on_cpu_and_honours_override():
    assert fp8_dtypes_for("cpu") == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_dtypes_for("cpu", fnuz=True) == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("granularity,block_size", GRANULARITIES)
def test_round_trip_sqnr_and_scale_reference(dtype, granularity, block_size):
    x = fresh(256, 384)
    q, scale = quantize_fp8(x, dtype=dtype, granularity=granularity, block_size=block_size)
    assert q.dtype == dtype and q.shape == x.shape
    x64 = x.double()
    if granularity == "tensorwise":
        ref_scale = x64.abs().max() / fp8_max(dtype)
        assert scale.shape == ()
    elif granularity == "rowwise":
        ref_scale = x64.abs().amax(dim=1, keepdim=True) / fp8_max(dtype)
    else:
        bm, bk = block_size
        ref_scale = x64.reshape(256 // bm, bm, 3, bk).abs().amax(dim=(1, 3)) / fp8_max(dtype)
    assert scale.shape == ref_scale.shape
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    assert sqnr_db(x, dequantize_fp8(q, scale, block_size=block_size)) >= 25.0


def test_dequantize_matches_float64_product():
    x = fresh(64, 256)
    q, scale = quantize_fp8(x, granularity="block", block_size=(1, 128))
    expected = q.double() * scale.double().repeat_interleave(128, dim=1)
    torch.testing.assert_close(dequantize_fp8(q, scale, block_size=(1, 128), dtype=torch.float64), expected)


@pytest.mark.parametrize("block_size", [(1, 128), (128, 128)])
def test_non_divisible_shapes_are_padded_and_returned_unpadded(block_size):
    x = fresh(130, 200)
    q, scale = quantize_fp8(x, granularity="block", block_size=block_size)
    bm, bk = block_size
    assert q.shape == (130, 200) and scale.shape == (-(-130 // bm), 2)
    # the trailing partial block is scaled by its own real elements only
    tail = x.double()[(scale.shape[0] - 1) * bm :, 128:]
    assert scale[-1, -1].item() == pytest.approx(tail.abs().max().item() / 448.0, rel=1e-6)
    assert sqnr_db(x, dequantize_fp8(q, scale, block_size=block_size)) >= 25.0


def test_block_granularity_keeps_leading_dims():
    x = fresh(2, 3, 256)
    q, scale = quantize_fp8(x, granularity="block", block_size=(1, 128))
    assert q.shape == (2, 3, 256) and scale.shape == (2, 3, 2)
    assert sqnr_db(x, dequantize_fp8(q, scale, block_size=(1, 128))) >= 25.0


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_clamp_before_cast_saturates_and_never_nans(dtype):
    x = fresh(32, 64) * 10
    scale = torch.tensor(1.0)  # calibrated "too small": most values land beyond fp8_max
    x[0, 0], x[0, 1] = 1e6, -1e6
    q = quantize_fp8_with_scale(x, scale, dtype=dtype)
    out = q.float()
    assert not torch.isnan(out).any()
    assert out[0, 0].item() == fp8_max(dtype) and out[0, 1].item() == -fp8_max(dtype)
    assert out.abs().max().item() == fp8_max(dtype)


def test_zero_tensor_and_zero_blocks_get_unit_scale():
    x = torch.zeros(4, 256)
    x[:, 128:] = fresh(4, 128)
    q, scale = quantize_fp8(x, granularity="block", block_size=(1, 128))
    assert torch.equal(scale[:, 0], torch.ones(4))
    assert not torch.isnan(q.float()).any() and torch.equal(q[:, :128].float(), torch.zeros(4, 128))


def test_power_of_two_scales_are_exact_powers_and_cover_amax():
    x = fresh(64, 256)
    q, scale = quantize_fp8(x, granularity="rowwise", power_of_two_scale=True)
    log2 = torch.log2(scale.double())
    assert torch.equal(log2, log2.round())
    assert (scale.double() * 448.0 >= x.double().abs().amax(dim=1, keepdim=True)).all()
    s = torch.tensor([0.25, 0.3, 1.0, 3.0])
    assert round_scale_to_power_of_two(s).tolist() == [0.25, 0.5, 1.0, 4.0]
    assert sqnr_db(x, dequantize_fp8(q, scale)) >= 25.0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="granularity='colwise'"):
        quantize_fp8(fresh(4, 4), granularity="colwise")
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8(fresh(4, 4), granularity="block", block_size=(0, 128))
    q, s = quantize_fp8(fresh(4, 256), granularity="block")
    with pytest.raises(ValueError, match="block_size"):
        dequantize_fp8(q, s)


def test_triton_backend_refuses_power_of_two_scales():
    x = fresh(4, 256)
    with pytest.raises(ValueError, match="backend='triton' with power_of_two_scale=True"):
        quantize_fp8(x, granularity="rowwise", power_of_two_scale=True, backend="triton")
    for backend in ("torch", "auto"):  # the neighbours: the torch path rounds the scales
        _, scale = quantize_fp8(x, granularity="rowwise", power_of_two_scale=True, backend=backend)
        assert torch.equal(scale, round_scale_to_power_of_two(scale))


def _operands(mode, m=96, n=256, k=512, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn):
    a, b = fresh(m, k), fresh(n, k)
    ga, ba, gb, bb = {
        "tensorwise": ("tensorwise", None, "tensorwise", None),
        "rowwise": ("rowwise", None, "rowwise", None),
        "blockwise": ("block", (1, 128), "block", (128, 128)),
    }[mode]
    aq, sa = quantize_fp8(a, dtype=a_dtype, granularity=ga, block_size=ba)
    bq, sb = quantize_fp8(b, dtype=b_dtype, granularity=gb, block_size=bb)
    return a, b, aq, sa, bq, sb


@pytest.mark.parametrize("mode,bar", [("tensorwise", 25.0), ("rowwise", 25.0), ("blockwise", 28.0)])
def test_scaled_mm_sqnr_vs_float64(mode, bar):
    a, b, aq, sa, bq, sb = _operands(mode)
    bias = fresh(256)
    out = scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32, bias=bias)
    ref = a.double() @ b.double().t() + bias.double()
    assert out.shape == (96, 256) and out.dtype == torch.float32
    assert sqnr_db(ref, out) >= bar


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "blockwise"])
def test_scaled_mm_equals_exact_emulation(mode):
    _, _, aq, sa, bq, sb = _operands(mode, m=16, n=32, k=256)
    exact = (dequantize_fp8(aq, sa, block_size=(1, 128) if mode == "blockwise" else None).double()
             @ dequantize_fp8(bq, sb, block_size=(128, 128) if mode == "blockwise" else None).double().t())
    out = scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(emulated_scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32).double(), exact,
                               rtol=1e-5, atol=1e-4)


def test_gemm_path_on_cpu_is_the_emulation():
    for mode in ("tensorwise", "rowwise", "blockwise"):
        _, _, aq, sa, bq, sb = _operands(mode, m=8, n=32, k=128)
        assert gemm_path(aq, sa, bq, sb) == "emulated"
    assert scaled_mm(aq, sa, bq, sb).dtype == torch.bfloat16


def test_torch_scaled_mm_cpu_tensorwise_agrees_with_emulation():
    _, _, aq, sa, bq, sb = _operands("tensorwise", m=4, n=16, k=64)
    fast = _torch_scaled_mm("tensorwise", aq, sa, bq, sb, torch.float32)
    torch.testing.assert_close(fast, emulated_scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32),
                               rtol=1e-5, atol=1e-4)


def test_scaled_mm_mixed_layouts_and_hybrid_dtypes_emulate():
    a, b = fresh(8, 256), fresh(32, 256)
    aq, sa = quantize_fp8(a, granularity="rowwise")
    bq, sb = quantize_fp8(b, dtype=torch.float8_e5m2, granularity="block", block_size=(128, 128))
    assert gemm_path(aq, sa, bq, sb) == "emulated"
    assert sqnr_db(a.double() @ b.double().t(), scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32)) >= 22.0


def test_scaled_mm_rejects_bad_operands():
    aq = torch.zeros(4, 64).to(torch.float8_e4m3fn)
    bq = torch.zeros(8, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K mismatch"):
        scaled_mm(aq, torch.tensor(1.0), bq, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale layout"):
        scaled_mm(aq, torch.ones(3, 3), aq.view(4, 64), torch.tensor(1.0))


def test_blockwise_dispatch_policy(monkeypatch):
    """Path choice as on an H200 with Triton (device checks stubbed): Triton for M < 4 and small
    decode shapes, cuBLAS otherwise, emulation when neither exists."""
    from lumenrl_quant import gemm

    monkeypatch.setattr(gemm, "_device_supports", lambda mode, device, k, out_dtype: True)
    monkeypatch.setattr(gemm, "_triton_blockwise_ok", lambda a_q, b_q, k: True)

    def path(m, k):
        _, _, aq, sa, bq, sb = _operands("blockwise", m=m, n=128, k=k)
        return gemm_path(aq, sa, bq, sb)

    assert path(1, 256) == path(3, 256) == "triton_blockwise"  # cuBLASLt has no kernel for M < 4
    assert path(16, 256) == "triton_blockwise"
    assert path(32, 256) == "scaled_mm_blockwise"
    assert path(8, 16384) == "scaled_mm_blockwise"  # large K: cuBLAS measured faster
    monkeypatch.setattr(gemm, "_triton_blockwise_ok", lambda a_q, b_q, k: False)
    assert path(1, 256) == "emulated" and path(8, 256) == "scaled_mm_blockwise"
