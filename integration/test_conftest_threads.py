"""The root conftest pins torch's intra-op threads to the worker's share before every test (``--dist loadfile``
runs this file's tests in order on one worker). Test modules used to call ``torch.set_num_threads`` at import, which
every worker does for every module while collecting, so the last module collected set the threads of the whole
run: two workers of two threads on 2 cores, and a loaded machine's run 2.5x slower (decision 0008)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = [*sorted((ROOT / "packages").glob("*/tests")), ROOT / "integration", ROOT / "benchmarks" / "tests"]


def _share() -> int:
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit():
        pytest.skip("OMP_NUM_THREADS is not set: no share to pin (pytest-xdist workers always have one)")
    return int(threads)


def test_a_test_leaves_torch_on_more_threads():
    _share()
    torch.set_num_threads(3)  # as a trainer built in-process does (trainer.cpu_threads)


def test_the_next_test_starts_on_the_share_again():
    assert torch.get_num_threads() == _share()


def test_one_thread_holds_for_the_test(one_thread):
    assert torch.get_num_threads() == 1


def test_no_test_module_sets_torch_threads_at_import():
    """A module-level call takes effect while collecting, for every test of the worker: use ``one_thread``."""
    offenders = []
    for folder in TEST_DIRS:
        for path in sorted(folder.glob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                call = node.value if isinstance(node, ast.Expr) else None
                if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("set_num_threads"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
