"""The run directory: what a run records about itself besides metrics and checkpoints.

``trainer.output_dir`` gets ``config.yaml`` (the resolved config; ``lumenrl train --config
output_dir/config.yaml`` reproduces the run), ``plugins.json`` (the plugin chosen for every role
with its distribution and version, plus the versions of torch / transformers / LumenRL
packages) and, at the end, ``summary.json`` (reward and eval before -> after) and then
``final/`` (the policy as a Hugging Face checkpoint with its tokenizer, written to a staging
directory and renamed into place: a kill during the export loses neither the summary nor an
earlier export; the final evaluation is also in the last checkpoint, so a restart with
``checkpointing.resume=true`` rewrites the same summary and finishes the export).

A directory that already holds a run (a ``config.yaml``): the same config (compared without the
keys that may change between a run and its continuation: ``RESUMABLE_KEYS``) with
``checkpointing.resume=true`` continues it; the same config without resume starts again and
replaces it; another config's run is refused unless ``trainer.overwrite=true``. A run that
replaces one first removes the old run's outputs (``RUN_OUTPUTS``), so two runs never mix in
one directory.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lumenrl_backends.versions import DISTRIBUTIONS, package_versions
from lumenrl_core.config import ConfigError, dump_config

__all__ = ["DISTRIBUTIONS", "RUN_OUTPUTS", "RESUMABLE_KEYS", "check_run_dir", "write_run_record", "write_summary",
           "package_versions"]

RUN_OUTPUTS = ("checkpoints", "final", ".final.staging", "metrics.jsonl", "summary.json", "tensorboard",
               "config.yaml", "plugins.json")
RESUMABLE_KEYS = ("trainer.overwrite", "checkpointing.resume", "num_training_steps", "logger.progress_bar")

def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _comparable(text: str) -> dict[str, Any]:
    config = yaml.safe_load(text) or {}
    for dotted in RESUMABLE_KEYS:
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return config


def check_run_dir(output_dir: str | os.PathLike[str], config: Any) -> None:
    """Refuse to mix two runs in ``output_dir`` (see the module docstring); clear it on ``overwrite``."""
    out = Path(output_dir)
    saved = out / "config.yaml"
    if not saved.is_file():
        return
    same = _comparable(saved.read_text()) == _comparable(dump_config(config))
    if same and config.checkpointing.resume:
        return  # continue it
    if not same and not config.trainer.overwrite:
        raise ConfigError(
            "trainer.output_dir",
            str(out),
            problem="holds another config's run (its config.yaml differs)",
            allowed="a new output_dir, or trainer.overwrite=true (removes the old run's outputs first)",
        )
    for name in RUN_OUTPUTS:  # overwrite, or the same config started again: the new run replaces the old
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def write_run_record(
    output_dir: str | os.PathLike[str], config: Any, plan_description: Mapping[str, Any]
) -> Path:
    """Create ``output_dir`` and write ``config.yaml`` + ``plugins.json``; return the directory."""
    check_run_dir(output_dir, config)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(config))
    record = {**plan_description, "packages": package_versions(), "python": platform.python_version()}
    _write_json(out / "plugins.json", record)
    return out


def write_summary(output_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> Path:
    path = Path(output_dir) / "summary.json"
    _write_json(path, dict(summary))
    return path
