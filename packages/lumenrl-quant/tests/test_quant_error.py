"""sqnr_db: the dB figure against a constructed noise level, exact inputs, shape errors."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_quant import sqnr_db


def test_sqnr_db_of_noise_at_a_known_level():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    noise = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    noise *= ref.norm() / noise.norm() / 100.0  # ||noise|| = ||ref|| / 100 -> 40 dB
    assert sqnr_db(ref, (ref + noise).float()) == pytest.approx(40.0, abs=1e-4)  # float32 rounding only


def test_sqnr_db_exact_and_shape_mismatch():
    x = torch.randn(8, 4)
    assert sqnr_db(x, x.clone()) == math.inf
    with pytest.raises(ValueError, match=r"\(8, 4\) != approx shape \(4, 8\)"):
        sqnr_db(x, x.t())
