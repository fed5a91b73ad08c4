"""Run checkpoints: written atomically, pruned to ``keep_last``, found again on resume.

Layout under ``trainer.output_dir/checkpoints``::

    step_000004/
        actor/            # backend.save_checkpoint: model, optimizer, LR scheduler
        critic/           # PPO only
        dataloader.json   # loader.state_dict(): epoch, position, shuffle seed
        rng.pt            # python / numpy / torch RNG states
        trainer_state.json  # step, weight version, anything the loop must restore

A checkpoint is first written to ``.tmp-step_000004`` and then renamed into place; ``rename``
is atomic on POSIX, so a directory named ``step_*`` is always complete and a crash mid-write
leaves only a ``.tmp-`` directory that the next save removes. Under torchrun every rank writes
its part of the backend checkpoints; rank 0 writes the rest and renames (barriers between).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.checkpoint import rng_state, set_rng_state

__all__ = ["CheckpointManager"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(kw_only=True, slots=True)
class CheckpointManager:
    """Saves, prunes and finds ``step_*`` checkpoints under ``root``."""

    root: Path
    keep_last: int = 2

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.keep_last < 1:
            raise ValueError(f"checkpointing.keep_last={self.keep_last!r} must be >= 1")

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        ]
        return sorted(found)

    def latest(self) -> Path | None:
        dirs = self.step_dirs()
        return dirs[-1][1] if dirs else None

    def save(
        self,
        step: int,
        *,
        backends: Mapping[str, Any],
        dataloader_state: Mapping[str, Any],
        trainer_state: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint ``step``: each backend under its role name, then rename into place."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        main = dist_utils.rank() == 0
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist_utils.barrier()
        for role, backend in backends.items():  # collective under torchrun: every rank writes its part
            backend.save_checkpoint(str(tmp / role))
        dist_utils.barrier()
        if main:
            (tmp / "dataloader.json").write_text(json.dumps(dataloader_state))
            torch.save(rng_state(), tmp / "rng.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune()
        dist_utils.barrier()
        return final

    def _prune(self) -> None:
        for _, path in self.step_dirs()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def load(path: Path, *, backends: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore backends and RNG from ``path``; return (trainer_state, dataloader_state)."""
        for role, backend in backends.items():
            backend.load_checkpoint(str(path / role))
        set_rng_state(torch.load(path / "rng.pt", weights_only=True))
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        dataloader_state = json.loads((path / "dataloader.json").read_text())
        return trainer_state, dataloader_state
