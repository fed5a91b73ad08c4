"""GRPO, DAPO and PPO each raise the demo task's reward by a clear margin within bounded steps.

The embedded demo: the built-in tiny Qwen3-architecture model, warm-started by a short SFT on
the bundled single-digit arithmetic task (shared across the tests), then RL on CPU. Checked
on the greedy mean reward over a fixed eval set (before training vs after the last step), with
a margin that holds over run seeds, not only at the preset's seed. The sampled training reward
is not checked for direction: every step draws new prompts, and over 16 steps it falls for
some seeds while the eval reward rises (measurements in the commit that set these bounds).
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
    # held-out greedy reward (the demo task's mean reward; = accuracy for the math reward). Over seeds 1-10
    # each preset gained 0.070-0.156 (smallest: GRPO 0.078, DAPO 0.070, PPO 0.086); the former bound 0.10
    # failed for 2-3 of 10 seeds per preset and passed at seed 1 by one prompt (GRPO). 0.04 (5 of 128
    # prompts) is about half the smallest gain measured.
    assert after["eval/reward_mean"] - before["eval/reward_mean"] >= 0.04, f"{preset}: {before} -> {after}"
    # the warm start gives RL a reward signal; where it lands above that is incidental (the margin above
    # is what must hold, and it already needs before <= 0.96)
    assert before["eval/accuracy"] >= 0.2, before
    algorithm_keys = {  # the machinery specific to each algorithm really ran
        "grpo_dense_bf16.yaml": {"actor/kl"},
        "dapo_dense_bf16.yaml": {"dapo/gen_batches", "dapo/kept_groups", "dapo/overlong_frac"},
        "ppo_dense_bf16.yaml": {"critic/vf_loss", "critic/grad_norm", "kl_in_reward/kl"},
    }[preset]
    assert all(set(r) >= algorithm_keys for r in records[1:])
