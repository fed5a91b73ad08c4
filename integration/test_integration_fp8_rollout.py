"""FP8 rollout + token TIS: the engine samples with FP8 weights, the trainer corrects with IS weights."""

from __future__ import annotations

from lumenrl_backends.loggers import read_metrics


def test_fp8_rollout_with_tis_trains_and_reports_the_mismatch(train, tmp_path):
    train("grpo_dense_fp8.yaml", tmp_path, "num_training_steps=2", "eval.enabled=false",
          "checkpointing.enabled=false", "dataset.train_batch_size=8", "policy.rollout.n=4")
    records = read_metrics(tmp_path)
    assert len(records) == 2
    for record in records:
        # FP8 weights perturb the rollout log-probs a little: ratios near 1, nothing extreme
        assert 0.8 < record["rollout_correction/is_ratio_mean"] < 1.25
        assert record["rollout_correction/kl_k3"] >= 0.0
        assert record["rollout_correction/is_weight_mean"] <= 2.0  # TIS cap C = 2
