"""GRPO with R3 end to end on CPU for every MoE family (configs/grpo_moe_r3.yaml, 2 steps):
the run completes, the ``moe/*`` metrics are in metrics.jsonl and finite, and with the engine
and trainer on the same weights the replayed routes agree (no flips, KL ~ 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lumenrl_core.assembly import plan_run
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.config import load_config

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


PRESET = Path(__file__).resolve().parents[3] / "configs" / "grpo_moe_r3.yaml"
MOE_KEYS = ("moe/route_flip_frac", "moe/train_infer_kl", "moe/extreme_token_frac@2", "moe/extreme_token_frac@5",
            "moe/expert_load_imbalance_mean", "moe/expert_load_imbalance_max")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def test_grpo_with_r3_runs_for_every_family(family, tmp_path, cache, monkeypatch):
    monkeypatch.setenv("LUMENRL_CACHE", str(cache))
    cfg = load_config(str(PRESET), [f"policy.model_name=lumenrl:tiny-{family}", f"trainer.output_dir={tmp_path}",
                                    "num_training_steps=2", "logger.backends=[jsonl]", "dataset.train_batch_size=4"])
    plan = plan_run(cfg)
    assert plan.plugin_names["moe_router"] == family
    plan.trainer_cls.from_plan(plan).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert all(k in row and math.isfinite(row[k]) for k in MOE_KEYS), row
        assert row["moe/route_flip_frac"] == 0.0 and row["moe/train_infer_kl"] < 1e-6
        assert row["moe/expert_load_imbalance_max"] >= 1.0
