"""`pip install ./packages/lumenrl-quant` into a fresh venv that has only torch, then run the README.

This is the promise other RL stacks rely on: lumenrl-quant installs and works with torch alone
(no lumenrl-core, no transformers). The venv gets the CPU build of torch pinned (`torch==2.13.0`),
as everywhere in this repo: the test environment's own torch install (and its requirements) linked
into the fresh venv when it is that version (``scripts/fresh_venv.py``: unpacking and byte-compiling
the torch wheel again costs half a minute of CPU), else pip installs it; pip then installs
lumenrl-quant from its source directory and resolves its declared dependencies against that.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from integration.readme_blocks import RUN_BLOCKS, python_blocks, write_scripts
from scripts import fresh_venv

ROOT = Path(__file__).resolve().parents[1]
QUANT = ROOT / "packages" / "lumenrl-quant"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory) -> Path:
    python = fresh_venv.create(tmp_path_factory.mktemp("quant-venv"))
    missing, pins = fresh_venv.link_distributions(fresh_venv.site_packages(python), [fresh_venv.TORCH_PIN])
    proc = fresh_venv.pip_install(python, [*missing, *pins, str(QUANT)])
    if proc.returncode != 0 and "No matching distribution" in proc.stderr:
        pytest.skip(f"{fresh_venv.TORCH_PIN} is not installable here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return python


_LIST = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"


def test_installs_with_torch_only(torch_only_python):
    proc = _run([str(torch_only_python), "-c", _LIST])
    assert proc.returncode == 0, proc.stderr[-2000:]
    installed = {line.strip().lower() for line in proc.stdout.splitlines()}
    assert "lumenrl-quant" in installed
    # numpy is declared (torch warns on import without it); nothing of the LLM stack comes along
    assert not installed & {"lumenrl-core", "transformers", "safetensors"}, installed
    probe = "import sys, lumenrl_quant; print(sorted(m for m in ('lumenrl_core', 'transformers') if m in sys.modules))"
    proc = _run([str(torch_only_python), "-c", probe])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_readme_examples_run_with_torch_only(torch_only_python, tmp_path):
    blocks = python_blocks(QUANT / "README.md")
    assert len(blocks) >= 3
    scripts = write_scripts({f"readme_{i}": code for i, code in enumerate(blocks)}, tmp_path)
    proc = _run([str(torch_only_python), "-c", RUN_BLOCKS, *map(str, scripts)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
