"""`pip install ./packages/lumenrl-quant` into a fresh venv that has only torch, then run the README.

This is the promise other RL stacks rely on: lumenrl-quant installs and works with torch alone
(no lumenrl-core, no transformers, no numpy). The venv gets the CPU build of torch pinned
(`torch==2.13.0`), as everywhere in this repo.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("quant-venv")
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    proc = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH_PIN, str(QUANT)])
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


def test_readme_examples_run_with_torch_only(torch_only_python, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (QUANT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        proc = _run([str(torch_only_python), str(script)], cwd=tmp_path)
        assert proc.returncode == 0, f"README block {i} failed:\n{proc.stderr[-3000:]}"

