"""Small helpers shared by the transfer engines."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["namespace_of", "cpu_copies", "atomic_write_text"]


def namespace_of(run_config: Any) -> str:
    """A shared-memory-safe namespace from the run's project and experiment names."""
    raw = f"{run_config.trainer.project_name}_{run_config.trainer.experiment_name}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw)[:48]


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU copies (later in-place writes by the producer do not leak)."""
    return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
