"""The run directory: what a run records about itself besides metrics and checkpoints.

``trainer.output_dir`` gets ``config.yaml`` (the resolved config; ``lumenrl train --config
output_dir/config.yaml`` reproduces the run), ``plugins.json`` (the plugin chosen for every role
with its distribution and version, plus the versions of torch / transformers / LumenRL
packages) and, at the end, ``final/`` (the policy as a Hugging Face checkpoint with its
tokenizer) and ``summary.json`` (reward and eval before -> after).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lumenrl_core.config import dump_config

__all__ = ["DISTRIBUTIONS", "write_run_record", "write_summary", "package_versions"]

DISTRIBUTIONS = (
    "lumenrl-core",
    "lumenrl-quant",
    "lumenrl-moe",
    "lumenrl-sddd",
    "lumenrl-async",
    "lumenrl-backends",
    "torch",
    "transformers",
)


def package_versions() -> dict[str, str | None]:
    """Installed versions of LumenRL's distributions and its key dependencies (None if absent)."""
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_run_record(
    output_dir: str | os.PathLike[str], config: Any, plan_description: Mapping[str, Any]
) -> Path:
    """Create ``output_dir`` and write ``config.yaml`` + ``plugins.json``; return the directory."""
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
