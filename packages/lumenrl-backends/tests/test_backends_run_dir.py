"""A run directory holds one run: another config's run is refused unless trainer.overwrite=true."""

from __future__ import annotations

from pathlib import Path

import pytest

from lumenrl_backends.trainers.outputs import RUN_OUTPUTS, check_run_dir, write_run_record
from lumenrl_core.config import ConfigError, load_config

PRESET = Path(__file__).resolve().parents[3] / "configs" / "grpo_dense_bf16.yaml"


def _config(out: Path, *overrides: str):
    return load_config(PRESET, [f"trainer.output_dir={out}", *overrides])


def _old_run(out: Path) -> None:
    write_run_record(out, _config(out), {})
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")


def test_another_configs_run_is_refused_unless_overwrite(tmp_path):
    _old_run(tmp_path)
    other = _config(tmp_path, "policy.optim.lr=5e-4")
    with pytest.raises(ConfigError, match=r"trainer.output_dir.*another config's run.*trainer.overwrite=true"):
        check_run_dir(tmp_path, other)
    assert (tmp_path / "metrics.jsonl").is_file()  # untouched
    write_run_record(tmp_path, _config(tmp_path, "policy.optim.lr=5e-4", "trainer.overwrite=true"), {})
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert "5e-4" in (tmp_path / "config.yaml").read_text() or "0.0005" in (tmp_path / "config.yaml").read_text()


def test_same_config_resumes_or_starts_again(tmp_path):
    _old_run(tmp_path)
    check_run_dir(tmp_path, _config(tmp_path, "checkpointing.resume=true", "num_training_steps=99"))
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()  # kept for the resume
    check_run_dir(tmp_path, _config(tmp_path))  # same config, no resume: the new run replaces the old
    assert not any((tmp_path / name).exists() for name in RUN_OUTPUTS)


def test_a_directory_without_a_run_is_used_as_is(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    check_run_dir(tmp_path, _config(tmp_path, "policy.optim.lr=5e-4"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_plugins_json_records_every_lumenrl_package_version(tmp_path):
    import importlib.metadata as metadata
    import json

    from lumenrl_backends.versions import LUMENRL_DISTRIBUTIONS

    write_run_record(tmp_path, _config(tmp_path), {"plugins": {"trainer": "rl"}})
    record = json.loads((tmp_path / "plugins.json").read_text())
    assert record["plugins"] == {"trainer": "rl"}
    assert {name: record["packages"][name] for name in LUMENRL_DISTRIBUTIONS} == {
        name: metadata.version(name) for name in LUMENRL_DISTRIBUTIONS}
    assert record["packages"]["torch"] == metadata.version("torch")
