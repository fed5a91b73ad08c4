"""The opening ```python block of every package README runs as-is, in a fresh interpreter.

That block is each package's use from outside LumenRL (the release checker runs it in a venv with only the
package and its declared dependencies). Here all six run in one subprocess, each as a script of its own
(``runpy.run_path``: fresh globals, ``__main__``), from an empty working directory: torch is imported once,
and a failing block is named with its traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from integration.readme_blocks import RUN_BLOCKS, python_blocks, write_scripts

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
READMES = sorted(PACKAGES.glob("lumenrl-*/README.md"))

def test_every_package_readme_opens_with_a_python_block():
    assert len(READMES) == 6
    for readme in READMES:
        text = readme.read_text()
        assert text.startswith("# lumenrl-"), readme
        first_fence = text.index("```")
        assert text[first_fence:].startswith("```python\n"), f"{readme}: the first code block is not python"
        assert "\n## " not in text[:first_fence], f"{readme}: a section comes before the opening example"


def test_opening_blocks_run_as_is(tmp_path):
    blocks = {readme.parent.name: python_blocks(readme) for readme in READMES}
    assert all(blocks.values()), [name for name, found in blocks.items() if not found]
    scripts = write_scripts({name: found[0] for name, found in blocks.items()}, tmp_path)
    proc = subprocess.run([sys.executable, "-c", RUN_BLOCKS, *map(str, scripts)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
