"""GRPO, DAPO and PPO each raise the demo task's reward by a clear margin within bounded steps.

The embedded demo: the built-in tiny Qwen3-architecture model, warm-started by a short SFT on
the bundled single-digit arithmetic task (shared across the tests), then RL on CPU. Checked
on the greedy mean reward over a fixed eval set (before training vs after the last step; the
clear margin) and on the sampled training reward (last 4 steps vs first 4; it moves less
cleanly because every step draws new prompts).
"""

from __future__ import annotations

import pytest

from lumenrl_backends.loggers import read_metrics

STEPS = 16


@pytest.mark.parametrize("preset", ["grpo_dense_bf16.yaml", "dapo_dense_bf16.yaml", "ppo_dense_bf16.yaml"])
def test_rl_raises_demo_reward(train, tmp_path, preset):
    summary = train(preset, tmp_path, f"num_training_steps={STEPS}", "checkpointing.enabled=false")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(0, STEPS + 1))  # step 0: the eval before training
    assert set(records[0]) >= {"eval/accuracy", "eval/reward_mean"}
    before, after = summary["eval_before"], summary["eval_after"]
    # held-out greedy reward (the demo task's mean reward; = accuracy for the math reward): robust
    assert after["eval/reward_mean"] - before["eval/reward_mean"] >= 0.10, f"{preset}: {before} -> {after}"
    # the warm start gives RL a reward signal; where it lands above that is incidental (the margin above
    # is what must hold, and it already needs before <= 0.9)
    assert before["eval/accuracy"] >= 0.2, before
    # training reward (sampled, on changing prompts: noisier): mean of the last 4 steps vs the first 4
    algorithm_keys = {  # the machinery specific to each algorithm really ran
        "grpo_dense_bf16.yaml": {"actor/kl"},
        "dapo_dense_bf16.yaml": {"dapo/gen_batches", "dapo/kept_groups", "dapo/overlong_frac"},
        "ppo_dense_bf16.yaml": {"critic/vf_loss", "critic/grad_norm", "kl_in_reward/kl"},
    }[preset]
    assert all(set(r) >= algorithm_keys for r in records[1:])
    rewards = [r["reward/mean"] for r in records[1:]]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, f"{preset}: {rewards}"
