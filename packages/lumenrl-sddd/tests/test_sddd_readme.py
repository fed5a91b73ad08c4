"""Every ```python block of the package README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_an_example():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    namespace = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
    if "hidden" in namespace:  # the shared-memory example: the tensor arrived and its segment is gone
        assert tuple(namespace["hidden"].shape) == (2, 16, 64)
        with pytest.raises(KeyError):
            namespace["trainer"].get("step3/rank0")
