"""A short GRPO run of the embedded demo with policy.rollout.exact_logprobs on: the rollout and training
log-probs are equal at every step (actor/logprob_max_abs_diff == 0; the check would raise otherwise)."""

from __future__ import annotations

from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_grpo_exact_mode_reports_zero_difference_every_step(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary_dir = tmp_path / "run"
        from lumenrl_core.assembly import plan_run
        from lumenrl_core.config import load_config

        config = load_config(CONFIGS / "grpo_dense_bf16.yaml", [
            f"trainer.output_dir={summary_dir}", "logger.progress_bar=false", "num_training_steps=2",
            "trainer.warm_start_sft_steps=0", "dataset.train_batch_size=2", "policy.rollout.n=4",
            "policy.rollout.max_batch_size=8", "policy.rollout.exact_logprobs=true",
            "policy.rollout.exact_logprobs_check=error", "eval.enabled=false",
        ])
        plan = plan_run(config)
        trainer = plan.trainer_cls.from_plan(plan)
        summary = trainer.fit()
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 2
    diffs = trainer.history["actor/logprob_max_abs_diff"]
    assert diffs == [0.0, 0.0]
