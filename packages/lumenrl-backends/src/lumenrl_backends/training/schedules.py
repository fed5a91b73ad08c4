"""Learning-rate schedules: constant, linear and cosine decay, each with linear warmup.

Design: a schedule is a pure function ``lr_multiplier(step) -> float`` (a fraction of the peak
``lr``), wrapped in ``torch.optim.lr_scheduler.LambdaLR`` so its position is part of the
optimizer's checkpointable state. ``step`` counts scheduler steps (one per optimizer step),
starting at 0 for the first optimizer step.

- warmup (all schedules): for ``step < warmup_steps`` the multiplier rises linearly
  ``(step + 1) / warmup_steps``, so the first step already trains (never lr = 0) and the last
  warmup step reaches the peak exactly.
- constant: 1 after warmup.
- linear: from 1 at ``step = warmup_steps`` down to ``min_lr_ratio`` at
  ``step = num_training_steps``; held at ``min_lr_ratio`` afterwards.
- cosine: ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))`` with
  ``progress = (step - warmup_steps) / (num_training_steps - warmup_steps)`` clamped to [0, 1].

All values are exact closed forms (float64 in Python); tests check them at key steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

__all__ = ["SCHEDULES", "LRSchedule", "lr_multiplier", "build_lr_scheduler", "optimizer_steps_per_training_step"]

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True, slots=True)
class LRSchedule:
    """A warmup + decay schedule, in units of scheduler (optimizer) steps."""

    name: str = field(default="constant", metadata={"choices": SCHEDULES})
    num_training_steps: int = 1  # step at which linear/cosine reach min_lr_ratio
    warmup_steps: int = 0  # linear warmup length
    min_lr_ratio: float = 0.0  # decay floor, as a fraction of the peak lr

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(
                f"lr_schedule={self.name!r} is not a known schedule; allowed: {', '.join(SCHEDULES)}"
            )
        if self.num_training_steps < 1:
            raise ValueError(f"num_training_steps={self.num_training_steps} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")


def lr_multiplier(schedule: LRSchedule, step: int) -> float:
    """The fraction of the peak lr used at scheduler step ``step`` (0-based)."""
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.name == "constant":
        return 1.0
    span = max(schedule.num_training_steps - schedule.warmup_steps, 1)
    progress = min(max((step - schedule.warmup_steps) / span, 0.0), 1.0)
    floor = schedule.min_lr_ratio
    if schedule.name == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying ``schedule`` to every param group of ``optimizer``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_multiplier, schedule))


def optimizer_steps_per_training_step(cfg: Any) -> int:
    """ppo_epochs x mini-batches per rollout batch (train_batch_size x rollout.n rows)."""
    train = cfg.policy.train
    rows = cfg.dataset.train_batch_size * cfg.policy.rollout.n
    mini = train.mini_batch_size or rows
    return train.ppo_epochs * -(-rows // mini)
