"""README code blocks run as scripts: what the README tests share.

``RUN_BLOCKS`` is a ``python -c`` program that runs each path it is given as a script of its own
(``runpy.run_path``: fresh globals, ``__main__``) in one interpreter, which pays torch's import once; a
failing block is named with its traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)

RUN_BLOCKS = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        sys.exit(f"README block {path} failed:\\n{traceback.format_exc()}")
"""


def python_blocks(readme: Path) -> list[str]:
    """The ```python blocks of ``readme``, in order."""
    return PYTHON_BLOCK.findall(readme.read_text())


def write_scripts(blocks: dict[str, str], folder: Path) -> list[Path]:
    """Each block as ``folder/<name>.py``; the paths, in order."""
    paths = []
    for name, code in blocks.items():
        paths.append(folder / f"{name}.py")
        paths[-1].write_text(code)
    return paths
