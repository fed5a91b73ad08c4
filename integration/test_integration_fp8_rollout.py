"""FP8 rollout + token TIS: the engine samples with FP8 weights, the trainer corrects with IS weights;
the correction's metrics (IS-weight quantiles, clipped/masked fractions) reach metrics.jsonl and the report."""

from __future__ import annotations

import math

import pytest

from lumenrl_backends.loggers import read_metrics
from lumenrl_backends.report import _draw_panel, plan_panels

CORRECTION_HEALTH = ("rollout_correction/is_weight_p5", "rollout_correction/is_weight_p50",
                     "rollout_correction/is_weight_p95", "rollout_correction/clipped_frac",
                     "rollout_correction/masked_frac")


@pytest.fixture(scope="module")
def fp8_run(train, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_tis")
    train("grpo_dense_fp8.yaml", out, "num_training_steps=2", "eval.enabled=false",
          "checkpointing.enabled=false", "dataset.train_batch_size=8", "policy.rollout.n=4")
    return out


def test_fp8_rollout_with_tis_trains_and_reports_the_mismatch(fp8_run):
    records = read_metrics(fp8_run)
    assert len(records) == 2
    for record in records:
        # FP8 weights perturb the rollout log-probs a little: ratios near 1, nothing extreme
        assert 0.8 < record["rollout_correction/is_ratio_mean"] < 1.25
        assert record["rollout_correction/kl_k3"] >= 0.0
        assert record["rollout_correction/is_weight_mean"] <= 2.0  # TIS cap C = 2


def test_is_weight_quantiles_and_fractions_are_logged_and_drawn_once(fp8_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(fp8_run)
    for record in records:
        assert all(math.isfinite(record[key]) for key in CORRECTION_HEALTH)
        p5, p50, p95 = (record[f"rollout_correction/is_weight_p{q}"] for q in (5, 50, 95))
        assert 0.0 < p5 <= p50 <= p95 <= 2.0  # token TIS: every valid token kept, weights capped at C = 2
        assert record["rollout_correction/masked_frac"] == 0.0  # TIS rejects nothing
    panels = plan_panels(records)
    placed = [key for _, keys in panels for key in keys]
    assert all(placed.count(key) == 1 for key in CORRECTION_HEALTH), placed
    title, keys = next((t, ks) for t, ks in panels if "rollout_correction/is_weight_p50" in ks)
    fig, ax = plt.subplots()
    assert _draw_panel(ax, records, title, keys) == [f"rollout_correction/is_weight_p{q}" for q in (5, 50, 95)]
    plt.close(fig)
