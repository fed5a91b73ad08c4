"""Every ```python block of the package README runs (its /shared/... path pointed at a temp dir)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    code = re.sub(r'"/shared/[^"]*"', repr(str(tmp_path / "weights")), BLOCKS[index])
    namespace = {"__name__": "__readme__"}
    exec(compile(code, f"README.md[python block {index}]", "exec"), namespace)
    if "version" in namespace:  # weight sync: the reader got what the trainer published
        assert namespace["version"] == 1 and tuple(namespace["tensors"]["lm_head.weight"].shape) == (8, 4)
    if "ctl" in namespace:  # staleness: the budget the README comment states
        assert namespace["n"] == 16 and namespace["ctl"].remaining == 45 - 16
