"""Metric loggers: ``lumenrl.loggers`` plugins selected by ``logger.backends``.

Every logger takes a flat ``{name: float}`` dict per step. ``jsonl`` writes the run's
``metrics.jsonl`` (one JSON object per step, the file ``lumenrl report`` reads); ``console``
prints a compact line; ``tensorboard`` and ``wandb`` are optional and say why when they cannot
run here. All are built with ``Cls.from_config(run_config)``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TextIO

from lumenrl_backends import plugin_manifest as manifest

__all__ = [
    "METRICS_FILE",
    "JsonlLogger",
    "ConsoleLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"

# Console line: the metrics worth a glance, in this order, with short labels.
_CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl", "kl"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "len"),
    ("perf/step_s", "step_s"),
)


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: write ``null`` for them so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All step records of ``run_dir/metrics.jsonl``, in file order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run_dir={str(run_dir)!r} has no {METRICS_FILE}")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


class JsonlLogger:
    """Appends one JSON object per step to ``trainer.output_dir/metrics.jsonl``.

    On resume from step k, records of steps > k (written after the checkpoint the run resumes
    from) are dropped first, so the file has exactly one record per step.
    """

    capabilities = manifest.JSONL.capabilities

    def __init__(self, output_dir: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            self._truncate_after(resume_step)
        self._file: TextIO | None = self.path.open("a")

    @classmethod
    def probe(cls) -> str | None:
        return manifest.JSONL.unavailable_reason()

    @classmethod
    def from_config(cls, config: Any, *, resume_step: int | None = None) -> JsonlLogger:
        return cls(config.trainer.output_dir, resume_step=resume_step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlLogger for {self.path} is closed")
        record = {"step": int(step), **{k: _finite_or_none(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ConsoleLogger:
    """Prints ``step 3 | reward 0.41 | kl 0.001 ...`` every ``logger.log_every`` steps.

    Writes through ``tqdm.write`` so lines do not tear the live progress bar.
    """

    capabilities = manifest.CONSOLE.capabilities

    def __init__(self, *, log_every: int = 1, stream: TextIO | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"logger.log_every={log_every!r} must be >= 1")
        self.log_every = log_every
        self.stream = stream

    @classmethod
    def probe(cls) -> str | None:
        return manifest.CONSOLE.unavailable_reason()

    @classmethod
    def from_config(cls, config: Any, **_: Any) -> ConsoleLogger:
        return cls(log_every=config.logger.log_every)

    @staticmethod
    def format_line(metrics: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}"]
        for key, label in _CONSOLE_KEYS:
            value = metrics.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                parts.append(f"{label} {value:.4g}")
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if step % self.log_every:
            return
        line = self.format_line(metrics, step)
        from tqdm import tqdm

        tqdm.write(line, file=self.stream or sys.stdout)

    def close(self) -> None:
        return None


class TensorBoardLogger:
    """Scalars to ``trainer.output_dir/tensorboard`` via ``torch.utils.tensorboard``."""

    capabilities = manifest.TENSORBOARD.capabilities

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    @classmethod
    def probe(cls) -> str | None:
        return manifest.TENSORBOARD.unavailable_reason()

    @classmethod
    def from_config(cls, config: Any, **_: Any) -> TensorBoardLogger:
        return cls(Path(config.trainer.output_dir) / "tensorboard")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases run named ``trainer.experiment_name`` in ``logger.wandb_project`` (empty: the run's
    ``trainer.project_name``)."""

    capabilities = manifest.WANDB.capabilities

    def __init__(self, *, project: str, name: str, run_config: Mapping[str, Any], output_dir: str) -> None:
        import wandb

        self.run = wandb.init(project=project, name=name, config=dict(run_config), dir=output_dir)

    @classmethod
    def probe(cls) -> str | None:
        return manifest.WANDB.unavailable_reason()

    @classmethod
    def from_config(cls, config: Any, **_: Any) -> WandbLogger:
        as_dict = asdict(config) if is_dataclass(config) else {}
        return cls(
            project=config.logger.wandb_project or config.trainer.project_name,
            name=config.trainer.experiment_name,
            run_config=as_dict,
            output_dir=config.trainer.output_dir,
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
