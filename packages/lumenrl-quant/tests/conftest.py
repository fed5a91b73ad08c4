"""Shared fixtures of lumenrl-quant's tests (imports only what lumenrl-quant declares: its iso env runs them).

``one_thread``: torch on one intra-op thread for a test module (``pytestmark =
pytest.mark.usefixtures("one_thread")``): small GEMMs on a shared CPU run ~10x faster than with a
thread per core fighting for it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
