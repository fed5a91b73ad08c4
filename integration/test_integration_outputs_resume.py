"""Run outputs (metrics.jsonl, checkpoints, config + plugin record, HF export, report) and
exact resume: a run stopped at step k and resumed gives the same step k+1 loss as an
uninterrupted run."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from lumenrl_backends.cli import main as lumenrl_main
from lumenrl_backends.loggers import TensorBoardLogger, read_metrics
from lumenrl_backends.report import plan_panels

REQUIRED_KEYS = {
    "step", "reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/kl", "actor/entropy",
    "actor/clip_frac", "perf/step_s", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
}
FAST = ("eval.enabled=false", "dataset.train_batch_size=8", "policy.rollout.n=4")


@pytest.fixture(scope="module")
def full_run(train, tmp_path_factory):
    """3 uninterrupted steps, checkpoint every step (keep 2), with TensorBoard."""
    out = tmp_path_factory.mktemp("full")
    backends = "[jsonl,console,tensorboard]" if TensorBoardLogger.probe() is None else "[jsonl,console]"
    train("grpo_dense_bf16.yaml", out, "num_training_steps=3", "checkpointing.save_every=1",
          "checkpointing.keep_last=2", f"logger.backends={backends}", *FAST)
    return out


def test_metrics_jsonl_has_the_specified_keys_every_step(full_run):
    records = read_metrics(full_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert set(record) >= REQUIRED_KEYS, REQUIRED_KEYS - set(record)
        assert all(isinstance(record[k], (int, float)) and math.isfinite(record[k]) for k in REQUIRED_KEYS)
        assert record["perf/rollout_tokens_per_s"] > 0 and record["perf/train_tokens_per_s"] > 0
        # the native engine and the FSDP2 forward agree on the same (synced) fp32 weights
        assert record["rollout/logprob_abs_diff_mean"] < 1e-4


def test_run_directory_records_config_plugins_checkpoints_and_final_model(full_run):
    config = yaml.safe_load((full_run / "config.yaml").read_text())
    assert config["num_training_steps"] == 3 and config["algorithm"]["name"] == "grpo"
    plugins = json.loads((full_run / "plugins.json").read_text())
    assert plugins["plugins"]["trainer"] == "rl" and plugins["packages"]["lumenrl-backends"]
    assert any(key.startswith("trainers/rl") for key in plugins["plugin_versions"])
    assert sorted(p.name for p in (full_run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    step3 = full_run / "checkpoints" / "step_000003"
    assert {"actor", "dataloader.json", "rng.pt", "trainer_state.json"} <= {p.name for p in step3.iterdir()}
    assert (full_run / "final" / "config.json").is_file()
    assert any((full_run / "final").glob("tokenizer*"))
    if TensorBoardLogger.probe() is None:
        assert list((full_run / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["steps"] == 3


def test_report_cli_writes_png_and_html(full_run, tmp_path):
    out, page = tmp_path / "curves.png", tmp_path / "report.html"
    assert lumenrl_main(["report", str(full_run), "--out", str(out), "--html", str(page)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = page.read_text()
    assert "data:image/png;base64," in text and "reward rising" not in text  # 3 steps: too few to judge
    titles = [t for t, _ in plan_panels(read_metrics(full_run))]
    assert any(t.startswith("train/infer log-prob gap") for t in titles)
    assert not any(t.startswith(("MoE", "async", "quantization")) for t in titles)  # a dense, sync, bf16 run
    keys = [k for _, ks in plan_panels(read_metrics(full_run)) for k in ks]
    assert len(keys) == len(set(keys))


def test_resume_reproduces_the_next_step_loss(train, full_run, tmp_path):
    train("grpo_dense_bf16.yaml", tmp_path, "num_training_steps=2", *FAST)  # stops after step 2
    train("grpo_dense_bf16.yaml", tmp_path, "num_training_steps=3", "checkpointing.resume=true", *FAST)
    resumed, uninterrupted = read_metrics(tmp_path), read_metrics(full_run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "reward/mean", "response_length/mean"):
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key
