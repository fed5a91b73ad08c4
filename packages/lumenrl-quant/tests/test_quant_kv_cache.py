"""FP8 KV cache: quantize/dequantize with per-tensor and per-head scales; percentile calibration."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_quant import KVScales, calibrate_kv_scales, dequantize_kv, percentile_amax, quantize_kv
from lumenrl_quant.error import sqnr_db


def kv(b=2, h=4, t=64, d=32):
    head_mag = torch.tensor([0.5, 1.0, 4.0, 16.0]).reshape(1, h, 1, 1)  # heads differ in range
    return torch.randn(b, h, t, d) * head_mag, torch.randn(b, h, t, d) * head_mag


def test_percentile_matches_float64_nearest_rank():
    x = torch.randn(3, 5, 7, 11)
    for p in (50.0, 99.0, 99.9, 100.0):
        flat = x.double().abs().flatten().sort().values
        rank = min(flat.numel(), max(1, math.ceil(p / 100 * flat.numel())))
        assert percentile_amax(x, p).item() == pytest.approx(flat[rank - 1].item(), rel=1e-7)
        per_head = percentile_amax(x, p, head_axis=1)
        for h in range(5):
            f = x[:, h].double().abs().flatten().sort().values
            r = min(f.numel(), max(1, math.ceil(p / 100 * f.numel())))
            assert per_head[h].item() == pytest.approx(f[r - 1].item(), rel=1e-7)


@pytest.mark.parametrize("per_head", [False, True])
def test_calibrate_then_round_trip(per_head):
    k, v = kv()
    q = torch.randn(2, 8, 64, 32)
    scales = calibrate_kv_scales(k, v, q, per_head=per_head)
    shape = (4,) if per_head else ()
    assert scales.k_scale.shape == shape and scales.v_scale.shape == shape
    assert scales.q_scale.shape == ((8,) if per_head else ())
    expected_k = percentile_amax(k, 99.9, head_axis=1 if per_head else None) * 1.05 / 448.0
    torch.testing.assert_close(scales.k_scale, expected_k)
    qk, qv = quantize_kv(k, v, scales)
    assert qk.dtype == torch.float8_e4m3fn and qk.shape == k.shape
    dk, dv = dequantize_kv(qk, qv, scales, dtype=torch.float32)
    assert not torch.isnan(dk).any() and not torch.isnan(dv).any()
    bar = 25.0 if per_head else 18.0  # per-tensor scales waste range on the small heads
    assert sqnr_db(k, dk) >= bar and sqnr_db(v, dv) >= bar
    # per-head scales resolve the smallest head far better than one tensor scale
    if per_head:
        assert sqnr_db(k[:, 0], dk[:, 0]) >= 25.0


def test_values_beyond_calibrated_range_saturate():
    k, v = kv()
    scales = calibrate_kv_scales(k, v, percentile=50.0, margin=1.0)  # deliberately tight
    qk, qv = quantize_kv(k * 10, v * 10, scales)
    assert not torch.isnan(qk.float()).any() and qk.float().abs().max().item() == 448.0


def test_recalibration_tracks_policy_change_and_zero_input():
    k, v = kv()
    s1 = calibrate_kv_scales(k, v)
    s2 = calibrate_kv_scales(k * 3, v * 3)
    torch.testing.assert_close(s2.k_scale, s1.k_scale * 3, rtol=1e-5, atol=0)
    z = calibrate_kv_scales(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), per_head=True)
    assert torch.equal(z.k_scale, torch.ones(2))


def test_kvscales_dataclass_helpers_and_errors():
    s = KVScales(k_scale=torch.tensor(0.1), v_scale=torch.tensor(0.2))
    assert set(s.as_dict()) == {"k_scale", "v_scale"} and s.to("cpu").v_scale.item() == pytest.approx(0.2)
    bad = KVScales(k_scale=torch.ones(3), v_scale=torch.ones(3))
    with pytest.raises(ValueError, match="heads"):
        quantize_kv(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), bad)
    with pytest.raises(ValueError, match="percentile"):
        calibrate_kv_scales(torch.randn(2, 2), torch.randn(2, 2), percentile=0)
    with pytest.raises(TypeError, match="v_scale"):
        KVScales(k_scale=torch.ones(()))  # keyword-only, v_scale required
