"""examples/other_stacks/trl_grpo_fp8_tis.py runs for real: TRL's GRPOTrainer, FP8 rollout copy, token-level TIS."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (hatch.toml's default env installs trl>=1.16,<1.17)")

from lumenrl_quant import QuantizedLinear  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "other_stacks" / "trl_grpo_fp8_tis.py"
FP8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz}
STEPS = 3


def _load_example():
    spec = importlib.util.spec_from_file_location("trl_grpo_fp8_tis", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return _load_example().main(steps=STEPS, output_dir=str(tmp_path_factory.mktemp("trl_fp8")))


def test_training_ran_every_step(trainer):
    assert trainer.state.global_step == STEPS
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)


def test_generation_copy_holds_fp8_weights_and_training_does_not(trainer):
    quantized = {n: m for n, m in trainer.rollout_model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(quantized) == set(trainer.rollout_report.quantized) and len(quantized) >= 14  # 7 linears x 2 layers
    assert all(m.weight.dtype in FP8 for m in quantized.values())
    assert not any(isinstance(m, QuantizedLinear) for m in trainer.model.modules())
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_fp8_perturbs_log_probs_and_tis_shrinks_the_kl(trainer):
    rows = [row for row in trainer.state.log_history if "rollout_correction/kl_before_tis" in row]
    assert len(rows) == STEPS  # logged every step
    for row in rows:
        assert row["rollout/logprob_abs_diff_mean"] > 1e-4  # FP8 weights move the sampled tokens' log-probs
        before, after = row["rollout_correction/kl_before_tis"], row["rollout_correction/kl_after_tis"]
        assert before > 0 and 0 <= after < before
        assert 0 < row["rollout_correction/is_weight_mean"] <= 2.0  # token TIS, cap 2
