"""Fresh virtual environments that reuse this interpreter's torch instead of installing it again.

A venv is made without pip (``venv.create(with_pip=False)``); packages go in with *this*
interpreter's pip, pointed at the venv by ``pip --python``. Installing the pinned CPU torch wheel
into every venv (unpacking and byte-compiling it) is the slow part of a clean-install check, so
:func:`link_distributions` symlinks the top-level entries of already-installed distributions
(and, transitively, what they require) into the venv's ``site-packages``: pip then sees them as
installed there and resolves the rest against them. Only distributions whose installed version
satisfies what the caller asks are linked, and each linked one is pinned to its version in the
pip call, so pip never upgrades (uninstalls through the symlink) a linked one.

Used by ``scripts/release_check.py`` and ``integration/test_integration_quant_standalone.py``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

__all__ = ["TORCH_PIN", "create", "link_distributions", "pip_install", "requirement_closure", "site_packages"]

TORCH_PIN = "torch==2.13.0"  # the CPU wheel every environment of this repository pins


def _run(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def create(env_dir: Path) -> Path:
    """Make a venv without pip at ``env_dir``; return its python."""
    venv.create(env_dir, with_pip=False, symlinks=True)
    return env_dir / "bin" / "python"


def site_packages(python: Path) -> Path:
    """The ``purelib`` directory of the interpreter ``python``."""
    proc = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    return Path(proc.stdout.strip())


def requirement_closure(name: str) -> list[metadata.Distribution]:
    """``name``'s installed distribution and those it requires (no extras), transitively."""
    found: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in found:
            continue
        found[key] = dist = metadata.distribution(key)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def _satisfied(requirement: Requirement) -> bool:
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(installed.split("+")[0], prereleases=True)


def link_distributions(site: Path, requirements: list[str]) -> tuple[list[str], list[str]]:
    """Symlink each installed distribution that satisfies one of ``requirements`` (with what it
    requires) into ``site``.

    Returns ``(missing, pins)``: the requirements not satisfied here (pip installs those) and
    ``name==version`` for every linked distribution. Pass both to pip: with the pins, a linked
    distribution that another requirement would need in a different version is a resolution
    error, never an upgrade that would uninstall through the symlink. ``setuptools`` is never
    linked (pip installs the venv's own)."""
    missing, linked = [], {}
    for line in requirements:
        req = Requirement(line)
        if not _satisfied(req):
            missing.append(line)
            continue
        for dist in requirement_closure(req.name):
            name = canonicalize_name(dist.metadata["Name"])
            if name == "setuptools" or name in linked:
                continue
            linked[name] = dist.version
            for entry in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
                if not (site / entry).exists():
                    os.symlink(dist.locate_file(entry), site / entry)
    return missing, [f"{name}=={version}" for name, version in linked.items()]


def pip_install(python: Path, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``pip install args`` into the environment of ``python`` with this interpreter's pip."""
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
           "--disable-pip-version-check", *args]
    return _run(cmd, timeout=timeout)
