"""Shared fixtures of the cross-package integration tests (CPU, seeded).

The built-in demo model and its warm-started SFT checkpoint are built once per session in the
session's empty ``LUMENRL_CACHE`` (the repository's ``conftest.py``) and reused by every test
(the warm start is cached by its settings and code), which keeps the suite within its CI budget.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session")
def lumenrl_cache() -> Path:
    """The session's model cache (an empty temporary directory: see the repository's conftest.py)."""
    return Path(os.environ["LUMENRL_CACHE"])


def run_preset(preset: str, output_dir: Path, *overrides: str) -> dict[str, Any]:
    """Run a preset in-process through the public path (load_config -> plan_run -> from_plan -> fit)."""
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    config = load_config(
        CONFIGS / preset,
        [f"trainer.output_dir={output_dir}", "logger.progress_bar=false", *overrides],
    )
    plan = plan_run(config)
    return plan.trainer_cls.from_plan(plan).fit()


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def child_env() -> dict[str, str]:
    """The environment for a run in a child process: this one's, less the 1-rank process group's
    ``RANK`` / ``MASTER_PORT`` / ... that in-process runs of the session leave in ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV}


@pytest.fixture(scope="session")
def train():
    """``train(preset, output_dir, *overrides) -> summary``: see :func:`run_preset`."""
    return run_preset
