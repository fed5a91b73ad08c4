"""GRPO with R3 under an FP8 rollout still raises the reward (issue #17).

A tiny Qwen3-MoE from scratch (``lumenrl:tiny-qwen3_moe``), the FP8 + R3 preset
(``configs/grpo_moe_fp8_r3.yaml``: blockwise FP8 rollout linears, routes recorded by the engine and
replayed by the trainer, token TIS), and a reward a random policy can learn in a few steps: the share
of response characters that are "7". The mean reward of the last steps must beat the first steps by a
clear margin, with every step's routes replayed (the trainer's own routing would flip some).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lumenrl_core.assembly import plan_run
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.config import load_config

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


PRESET = Path(__file__).resolve().parents[1] / "configs" / "grpo_moe_fp8_r3.yaml"
REWARD = '''
def sevens(prompts, responses, extra):
    return [sum(c == "7" for c in r) / max(len(r), 1) for r in responses]
'''


def test_grpo_with_r3_and_fp8_rollout_raises_the_reward(tmp_path):
    (tmp_path / "reward7.py").write_text(REWARD)
    steps = 8
    cfg = load_config(str(PRESET), [
        f"reward.function={tmp_path / 'reward7.py'}:sevens", f"trainer.output_dir={tmp_path / 'run'}",
        f"num_training_steps={steps}", "logger.backends=[jsonl]", "dataset.train_batch_size=8",
        "policy.rollout.n=8", "policy.rollout.max_new_tokens=6", "policy.optim.lr=1e-2"])
    plan = plan_run(cfg)
    plan.trainer_cls.from_plan(plan).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.15, rewards
    assert all("moe/route_flip_frac" in r and r["moe/train_infer_kl"] >= 0 for r in rows)
