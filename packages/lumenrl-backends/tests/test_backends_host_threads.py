"""trainer.cpu_threads: torch's intra-op threads in a run's process, before and after the models load."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.trainers.build import set_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_set_value_holds_from_the_start_on_any_device(threads):
    set_host_threads(3)
    assert torch.get_num_threads() == 3
    set_host_threads(3, torch.device("cuda"))  # after loading: unchanged
    assert torch.get_num_threads() == 3


def test_unset_keeps_the_default_on_the_cpu(threads):
    set_host_threads(0)
    set_host_threads(0, torch.device("cpu"))
    assert torch.get_num_threads() == threads


def test_unset_means_one_thread_once_the_models_are_on_an_accelerator(threads):
    set_host_threads(0)
    assert torch.get_num_threads() == threads  # loading keeps the pool (checkpoint conversions on the host)
    set_host_threads(0, torch.device("cuda", 0))
    assert torch.get_num_threads() == 1
