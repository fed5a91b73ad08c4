"""Shared fixtures of the cross-package integration tests (CPU, seeded).

The built-in demo model and its warm-started SFT checkpoint are built once per session in a
session-wide ``LUMENRL_CACHE`` and reused by every test (the warm start is cached by its
settings), which keeps the suite within its CI budget.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session", autouse=True)
def lumenrl_cache(tmp_path_factory: pytest.TempPathFactory):
    """One model cache for the whole session (hermetic: not the user's ~/.cache)."""
    previous = os.environ.get("LUMENRL_CACHE")
    path = tmp_path_factory.mktemp("lumenrl_cache")
    os.environ["LUMENRL_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("LUMENRL_CACHE", None)
    else:
        os.environ["LUMENRL_CACHE"] = previous


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


@pytest.fixture(scope="session")
def train():
    """``train(preset, output_dir, *overrides) -> summary``: see :func:`run_preset`."""
    return run_preset
