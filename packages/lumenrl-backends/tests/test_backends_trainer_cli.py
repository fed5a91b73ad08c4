"""`lumenrl train` refuses bad configs with ONE line and exit status 2, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PRESET = REPO / "configs" / "grpo_dense_bf16.yaml"


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LUMENRL_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "lumenrl_backends.cli", "train", "--config", str(PRESET),
           f"trainer.output_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _assert_refused_early(result: subprocess.CompletedProcess, tmp_path: Path) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "cache").exists(), "a model was materialised before the config was refused"
    assert not (tmp_path / "run").exists()
    return lines[0]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("policy.rollout.temprature=0.5", "temperature"),  # unknown key: names the closest valid key
        ("num_training_steps=many", "num_training_steps"),  # wrong type
    ],
)
def test_config_errors_are_one_line_before_loading(tmp_path, override, expected):
    line = _assert_refused_early(_train(tmp_path, override), tmp_path)
    assert expected in line


def test_incompatible_combinations_are_all_reported_in_one_line(tmp_path):
    # MX training + PPO without a critic: every assembly violation at once (R3, not built yet, is
    # refused at load: test_core_config_refused.py)
    result = _train(tmp_path, "quantization.training.precision=mxfp8", "algorithm.name=ppo",
                    "algorithm.adv_estimator=gae")
    line = _assert_refused_early(result, tmp_path)
    assert "critic.enabled" in line and "quantization.training.precision" in line
