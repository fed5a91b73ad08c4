"""Loggers, the run report, and atomic checkpoints of the RL trainer."""

from __future__ import annotations

import io
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lumenrl_backends.loggers import ConsoleLogger, JsonlLogger, TensorBoardLogger, WandbLogger, read_metrics
from lumenrl_backends.report import series, write_report
from lumenrl_backends.trainers.checkpoint import CheckpointManager
from lumenrl_backends.training.checkpoint import rng_state, set_rng_state


def _fake_records(n: int = 6) -> list[dict[str, float]]:
    rng = random.Random(3)
    return [
        {
            "reward/mean": 0.2 + 0.1 * s + rng.random() * 0.01,
            "reward/std": 0.3,
            "actor/kl": 0.01 * s,
            "actor/entropy": 1.0 - 0.05 * s,
            "response_length/mean": 3.0 + rng.random(),
            "perf/rollout_tokens_per_s": 100.0 + s,
            "perf/train_tokens_per_s": 200.0 + s,
            "actor/pg_loss": rng.uniform(-0.1, 0.1),
        }
        for s in range(1, n + 1)
    ]


def test_jsonl_logger_writes_one_valid_json_object_per_step(tmp_path):
    logger = JsonlLogger(tmp_path)
    logger.log({"reward/mean": 0.5, "actor/kl": math.nan}, step=1)
    logger.log({"reward/mean": 0.7, "actor/kl": 0.01}, step=2)
    logger.close()
    records = read_metrics(tmp_path)
    assert records == [
        {"step": 1, "reward/mean": 0.5, "actor/kl": None},  # NaN is not JSON: written as null
        {"step": 2, "reward/mean": 0.7, "actor/kl": 0.01},
    ]
    with pytest.raises(RuntimeError, match="closed"):
        logger.log({"x": 1.0}, step=3)


def test_jsonl_logger_on_resume_drops_records_after_the_checkpoint(tmp_path):
    logger = JsonlLogger(tmp_path)
    for step in range(1, 6):
        logger.log({"reward/mean": float(step)}, step=step)
    logger.close()
    resumed = JsonlLogger(tmp_path, resume_step=3)  # steps 4, 5 were written after the checkpoint
    resumed.log({"reward/mean": 40.0}, step=4)
    resumed.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    JsonlLogger(tmp_path).close()  # a fresh (non-resumed) run starts an empty file
    assert read_metrics(tmp_path) == []


def test_console_logger_prints_selected_metrics_every_n_steps():
    stream = io.StringIO()
    logger = ConsoleLogger(log_every=2, stream=stream)
    logger.log({"reward/mean": 0.25, "actor/kl": 0.001, "unlisted/metric": 9.0}, step=1)
    logger.log({"reward/mean": 0.5, "actor/kl": math.nan, "actor/entropy": 1.5}, step=2)
    assert stream.getvalue().strip() == "step 2 | reward 0.5 | entropy 1.5"
    with pytest.raises(ValueError, match="log_every"):
        ConsoleLogger(log_every=0)


def test_tensorboard_logger_writes_event_file(tmp_path):
    if TensorBoardLogger.probe() is not None:
        pytest.skip(TensorBoardLogger.probe())
    logger = TensorBoardLogger(tmp_path / "tb")
    logger.log({"reward/mean": 0.5, "actor/kl": math.nan}, step=1)
    logger.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_probe_reason_names_the_install_when_missing():
    reason = WandbLogger.probe()
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert reason is not None and "lumenrl-backends[wandb]" in reason
    else:
        assert reason is None or "wandb" in reason


def test_report_writes_png_with_available_panels(tmp_path):
    logger = JsonlLogger(tmp_path)
    for step, record in enumerate(_fake_records(), start=1):
        logger.log(record, step)
    logger.close()
    steps, values = series(read_metrics(tmp_path), "actor/kl")
    assert steps == [1, 2, 3, 4, 5, 6] and values[0] == pytest.approx(0.01)
    out = write_report(tmp_path)
    assert out == tmp_path / "report.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_report_cli_errors_are_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lumenrl_backends.cli", "report", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "metrics.jsonl" in result.stderr and "Traceback" not in result.stderr


class _FakeBackend:
    """Saves/loads one tensor: enough to check what CheckpointManager does with backends."""

    def __init__(self, value: float) -> None:
        self.weight = torch.full((3,), value)

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        torch.save(self.weight, Path(path) / "w.pt")

    def load_checkpoint(self, path: str) -> None:
        self.weight = torch.load(Path(path) / "w.pt")


def test_checkpoints_are_atomic_pruned_and_restore_state(tmp_path):
    manager = CheckpointManager(root=tmp_path / "ckpt", keep_last=2)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".tmp-step_000009").mkdir()  # debris of a crashed save
    for step in (1, 2, 3):
        manager.save(step, backends={"actor": _FakeBackend(float(step))}, dataloader_state={"position": step},
                     trainer_state={"note": f"s{step}"})
    assert [s for s, _ in manager.step_dirs()] == [2, 3]
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    restored = _FakeBackend(0.0)
    trainer_state, loader_state = CheckpointManager.load(manager.latest(), backends={"actor": restored})
    assert trainer_state == {"note": "s3", "step": 3} and loader_state == {"position": 3}
    assert torch.equal(restored.weight, torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(root=tmp_path, keep_last=0)


def test_rng_capture_restore_replays_the_same_draws():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(4))
    set_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(4))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


def test_read_metrics_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert read_metrics(tmp_path) == [{"step": 1}]
