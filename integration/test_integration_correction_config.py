"""Config -> assembly -> lumenrl-quant correction plugins: the MIS band defaults per mode."""

from __future__ import annotations

import pytest
import torch

from lumenrl_core.assembly import plan_run
from lumenrl_core.config import load_config


def _built(mode: str, *overrides: str):
    cfg = load_config(None, ["quantization.rollout_correction.enabled=true",
                             f"quantization.rollout_correction.mode={mode}", *overrides])
    return plan_run(cfg).build_rollout_correction()


@pytest.mark.parametrize(("mode", "band"), [("mis_token", (0.5, 2.0)), ("mis_seq", (0.5, 2.0)),
                                            ("seq_mis", (0.5, 2.0)), ("mis_geo", (0.999, 1.001))])
def test_unset_band_takes_the_modes_default(mode, band):
    corr = _built(mode)
    assert (corr.mask_low, corr.mask_high) == band


def test_explicit_band_reaches_the_plugin_and_masks():
    corr = _built("mis_token", "quantization.rollout_correction.mask_low=0.9",
                  "quantization.rollout_correction.mask_high=1.1")
    assert (corr.mask_low, corr.mask_high) == (0.9, 1.1)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[0.0, 0.5, -0.05]])  # ratios exp(0)=1, exp(-0.5)~0.61, exp(0.05)~1.05
    _, keep, _ = corr(old, rollout, torch.ones(1, 3))
    assert keep.tolist() == [[1.0, 0.0, 1.0]]
