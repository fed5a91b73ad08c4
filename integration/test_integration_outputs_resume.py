"""Run outputs (metrics.jsonl, checkpoints, config + plugin record, HF export, report) and
exact resume: a run stopped at step k and resumed gives the same step k+1 loss as an
uninterrupted run, and says where it resumed from; a run killed during its final export keeps
its final evaluation, and a restart finishes the export."""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from lumenrl_backends.cli import main as lumenrl_main
from lumenrl_backends.loggers import TensorBoardLogger, read_metrics
from lumenrl_backends.report import plan_panels

REQUIRED_KEYS = {
    "step", "reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/kl", "actor/entropy",
    "actor/clip_frac", "perf/step_s", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
}
PRESET = Path(__file__).resolve().parents[1] / "configs" / "grpo_dense_bf16.yaml"
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


@pytest.fixture(scope="module")
def resumed_run(train, tmp_path_factory):
    """Stopped after step 2, then resumed to step 3: (run directory, what the resumed run printed)."""
    out = tmp_path_factory.mktemp("resumed")
    train("grpo_dense_bf16.yaml", out, "num_training_steps=2", *FAST)  # stops after step 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train("grpo_dense_bf16.yaml", out, "num_training_steps=3", "checkpointing.resume=true", *FAST)
    return out, printed.getvalue()


def test_resume_reproduces_the_next_step_loss(full_run, resumed_run):
    resumed, uninterrupted = read_metrics(resumed_run[0]), read_metrics(full_run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "reward/mean", "response_length/mean"):
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key


def test_a_resumed_run_prints_where_it_resumed_from(resumed_run):
    out, printed = resumed_run
    assert f"resumed from step 2 of 3: checkpoint {out / 'checkpoints' / 'step_000002'}" in printed.splitlines()


# the run in a child process, whose final export starts (a partial file in its staging directory) and hangs
HANG_IN_THE_FINAL_EXPORT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    from lumenrl_backends.cli import main
    from lumenrl_backends.training.fsdp2 import FSDP2Backend

    def hang(self, path, tokenizer=None):
        if Path(path).name != ".final.staging":  # a warm start's export, say
            return save_hf(self, path, tokenizer=tokenizer)
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        time.sleep(600)

    save_hf, FSDP2Backend.save_hf = FSDP2Backend.save_hf, hang
    sys.exit(main(["train", "--config", sys.argv[1], *sys.argv[2:]]))
    """
)


def _run_until_the_export_hangs(out, overrides: list[str], env: dict[str, str]) -> None:
    """Start the run in a child process (a fresh interpreter: a forked one would share this one's
    process group), SIGKILL it once its final export has begun."""
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as sink:
        child = subprocess.Popen([sys.executable, "-c", HANG_IN_THE_FINAL_EXPORT, str(PRESET),
                                  f"trainer.output_dir={out}", "logger.progress_bar=false", *overrides],
                                 stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    try:
        while not (out / ".final.staging" / "model.safetensors").exists():
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)  # a no-op for a child that already ended
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_a_kill_during_the_final_export_keeps_the_final_evaluation(train, tmp_path, child_env):
    out = tmp_path / "run"
    overrides = ["num_training_steps=1", "eval.num_examples=8", "dataset.train_batch_size=4", "policy.rollout.n=2"]
    _run_until_the_export_hangs(out, overrides, child_env)
    summary = json.loads((out / "summary.json").read_text())  # written (atomically) before the export
    final_eval = summary["eval_after"]
    assert set(final_eval) >= {"eval/accuracy", "eval/reward_mean"} and not (out / "final").exists()
    assert read_metrics(out)[-1]["eval/accuracy"] == final_eval["eval/accuracy"]
    train("grpo_dense_bf16.yaml", out, *overrides, "checkpointing.resume=true")  # the restart: export only
    assert json.loads((out / "summary.json").read_text())["eval_after"] == final_eval
    assert (out / "final" / "config.json").is_file() and not (out / ".final.staging").exists()
    assert (out / "final" / "model.safetensors").read_bytes() != b"partial"
