"""The R3 benchmark's direction (smoke shapes, CPU): under an FP8 rollout the trainer's own
routing flips some routes and R3 removes every flip and cuts the train/infer KL >= 2x."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lumenrl_core.assembly.requirements import moe_layout_supported

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: benchmarks/


def test_r3_removes_flips_and_cuts_the_kl():
    from benchmarks.moe.r3_mismatch import r3_mismatch

    out = r3_mismatch(smoke=True)
    assert out["route_flip_frac_without_r3"] > 0.0 and out["train_infer_kl_without_r3"] > 0.0
    assert out["route_flip_frac_with_r3"] == 0.0
    assert out["kl_cut"] >= 2.0, out
