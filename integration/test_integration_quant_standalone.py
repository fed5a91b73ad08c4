"""`pip install ./packages/lumenrl-quant` into a fresh venv that has only torch, then run the README.

This is the promise other RL stacks rely on: lumenrl-quant installs and works with torch alone
(no lumenrl-core, no transformers, no numpy). The venv gets the CPU build of torch pinned
(`torch==2.13.0`), as everywhere in this repo: the test environment's own torch install (and its
requirements) linked into the fresh venv when it is that version (unpacking and byte-compiling the torch
wheel again costs half a minute of CPU), else pip installs it; pip then installs lumenrl-quant and
resolves its declared dependencies against that.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUANT = ROOT / "packages" / "lumenrl-quant"
TORCH_PIN = "torch==2.13.0"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def _requirement_closure(name: str) -> list[importlib.metadata.Distribution]:
    """``name``'s installed distribution and those it requires (no extras), transitively."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in found:
            continue
        found[key] = dist = importlib.metadata.distribution(key)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def _link_installed_torch(site: Path) -> bool:
    """Symlink this environment's torch (when it is the pinned version) and its requirements into ``site``."""
    try:
        if importlib.metadata.version("torch").split("+")[0] != TORCH_PIN.partition("==")[2]:
            return False
        closure = _requirement_closure("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    for dist in closure:
        if dist.metadata["Name"].lower() == "setuptools":
            continue  # the venv has its own: pip upgrades it if torch asks for a newer one
        for entry in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (site / entry).exists():
                os.symlink(dist.locate_file(entry), site / entry)
    return True


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("quant-venv")
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    torch = [] if _link_installed_torch(Path(purelib)) else [TORCH_PIN]
    proc = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *torch, str(QUANT)])
    if proc.returncode != 0 and "No matching distribution" in proc.stderr:
        pytest.skip(f"{TORCH_PIN} is not installable here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return python


def test_installs_with_torch_only(torch_only_python):
    proc = _run([str(torch_only_python), "-m", "pip", "list", "--format=freeze"])
    installed = {line.split("==")[0].lower() for line in proc.stdout.splitlines()}
    assert "lumenrl-quant" in installed
    # numpy is declared (torch warns on import without it); nothing of the LLM stack comes along
    assert not installed & {"lumenrl-core", "transformers", "safetensors"}, installed
    probe = "import sys, lumenrl_quant; print(sorted(m for m in ('lumenrl_core', 'transformers') if m in sys.modules))"
    proc = _run([str(torch_only_python), "-c", probe])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# Runs each README block as a script of its own (``runpy.run_path``: fresh globals, ``__main__``) in one
# interpreter, which pays torch's import once; a failing block is named with its traceback.
_RUN_BLOCKS = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        sys.exit(f"README block {path} failed:\\n{traceback.format_exc()}")
"""


def test_readme_examples_run_with_torch_only(torch_only_python, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (QUANT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    scripts = []
    for i, code in enumerate(blocks):
        scripts.append(tmp_path / f"readme_{i}.py")
        scripts[-1].write_text(code)
    proc = _run([str(torch_only_python), "-c", _RUN_BLOCKS, *map(str, scripts)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
