"""A short GRPO run of the embedded demo with ``policy.training_backend=megatron`` (actor and
reference on Megatron-Core, weights streamed to the native engine under HF names). Skipped when
megatron-core is not installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.plugin_manifest import megatron_missing_api as missing_api

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.skipif(missing_api() is not None, reason=str(missing_api()))
def test_grpo_demo_runs_on_the_megatron_backend(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from lumenrl_core.assembly import plan_run
        from lumenrl_core.config import load_config

        config = load_config(
            CONFIGS / "grpo_dense_bf16.yaml",
            [
                f"trainer.output_dir={tmp_path / 'run'}",
                "logger.progress_bar=false",
                "num_training_steps=2",
                "trainer.warm_start_sft_steps=0",
                "dataset.train_batch_size=2",
                "policy.rollout.n=4",
                "policy.rollout.max_batch_size=8",
                "eval.enabled=false",
                "policy.training_backend=megatron",
            ],
        )
        plan = plan_run(config)
        trainer = plan.trainer_cls.from_plan(plan)
        summary = trainer.fit()
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 2
    # the engine (fed by sync_to_engine from the Megatron weights under HF names) and the Megatron
    # forward agree on the sampled tokens' log-probs at every step
    diffs = trainer.history["actor/logprob_max_abs_diff"]
    assert len(diffs) == 2 and all(d < 1e-4 for d in diffs)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["actor/grad_norm"]) for m in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "actor").is_dir()  # DCP checkpoint
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32)  # save_hf
    assert all(torch.isfinite(p).all() for p in final.parameters())
