"""Built artifacts on disk (built-in models, warm starts): keyed by what builds them, checked before use.

An entry lives at ``<parent>/<name>`` and is trusted only if all of these hold:

- its manifest ``lumenrl-build.json`` exists and records the expected ``key``; the key hashes
  everything that determines the artifact: the caller's settings, the source code of the modules
  that build it (:func:`source_hash`) and the torch / transformers versions — never just the
  package version, which stays 0.1.0 while the code changes;
- ``config.json`` parses as a JSON object;
- every ``*.safetensors`` file's header reads and its tensors fit the file (a truncated copy fails);
- at least one weight file exists.

Anything else (a stale key, a partial copy, a bad config) is removed and rebuilt. A build
writes into a staging directory ``.<name>.<pid>.XXXX`` beside the target and renames it into
place (atomic on one filesystem), so readers never see a half-written entry; staging
directories whose process is gone (an interrupted build) are removed on the next build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["MANIFEST", "source_hash", "artifact_key", "entry_is_valid", "clean_stale_staging", "build_entry"]

MANIFEST = "lumenrl-build.json"


def _module_files(module: ModuleType) -> list[Path]:
    """The ``.py`` files of a module, or of every module in a package (sorted, recursive)."""
    path = Path(module.__file__ or "")
    if path.name == "__init__.py":
        return sorted(p for p in path.parent.rglob("*.py") if "__pycache__" not in p.parts)
    return [path]


def source_hash(modules: Iterable[ModuleType]) -> str:
    """SHA-256 over the source files of ``modules`` (packages: all their files), with their relative names."""
    digest = hashlib.sha256()
    for module in modules:
        for file in _module_files(module):
            digest.update(f"{module.__name__}:{file.name}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def artifact_key(material: dict[str, Any], modules: Iterable[ModuleType]) -> str:
    """16 hex digits over ``material`` + the builders' source + torch/transformers versions."""
    import torch
    import transformers

    full = {
        **material,
        "source": source_hash(modules),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _safetensors_ok(path: Path) -> bool:
    """The header parses and every tensor's byte range lies inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                return False
            header = json.loads(f.read(header_len))
        data = size - 8 - header_len
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            if not 0 <= start <= end <= data:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def entry_is_valid(path: Path, key: str) -> bool:
    """``path`` is a complete build of ``key`` (see the module docstring for what is checked)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("key") != key or not isinstance(config, dict):
        return False
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    return bool(weights) and all(_safetensors_ok(w) for w in weights if w.suffix == ".safetensors")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_staging(parent: Path, name: str) -> list[Path]:
    """Remove ``.<name>.<pid>.*`` staging directories whose building process is gone; returns them."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in parent.glob(f".{name}.*"):
        pid = path.name[len(name) + 2 :].split(".", 1)[0]
        if path.is_dir() and (not pid.isdigit() or not _pid_alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def build_entry(target: Path, key: str, build: Callable[[Path], Any], material: dict[str, Any] | None = None) -> Path:
    """``target`` holding a valid build of ``key``: reused if valid, else (re)built atomically."""
    if entry_is_valid(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target.parent, target.name)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    try:
        build(staging)
        (staging / MANIFEST).write_text(json.dumps({"key": key, **(material or {})}, sort_keys=True, default=str))
        if target.exists() and not entry_is_valid(target, key):  # stale or corrupt: move it aside first
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not entry_is_valid(target, key):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
