"""Small helpers shared by the transfer engines."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["namespace_of"]


def namespace_of(run_config: Any) -> str:
    """A shared-memory-safe namespace from the run's project and experiment names."""
    raw = f"{run_config.trainer.project_name}_{run_config.trainer.experiment_name}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw)[:48]
