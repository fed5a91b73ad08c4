"""Staleness budget: (1 + s) * sync_step * require_batches * mini_batch_size - stale queued."""

from __future__ import annotations

import pytest

from lumenrl_async import StalenessConfig, StalenessController
from lumenrl_core.config.schema import RunConfig


@pytest.mark.parametrize(
    ("s", "sync_step", "require_batches", "mini", "expected"),
    [(0.0, 1, 1, 4, 4), (0.0, 4, 1, 8, 32), (0.5, 2, 2, 8, 48), (0.1, 1, 1, 5, 5), (0.3, 1, 1, 10, 13), (1.0, 3, 2, 7, 84)],
)
def test_window_capacity_formula(s, sync_step, require_batches, mini, expected):
    cfg = StalenessConfig(staleness_threshold=s, trigger_parameter_sync_step=sync_step,
                          require_batches=require_batches, mini_batch_size=mini)
    assert cfg.window_samples() == sync_step * require_batches * mini
    assert cfg.window_capacity() == expected


def test_budget_subtracts_stale_queued():
    ctl = StalenessController(StalenessConfig(staleness_threshold=0.5, trigger_parameter_sync_step=2,
                                              require_batches=2, mini_batch_size=8))
    assert ctl.budget(0) == 48 and ctl.budget(10) == 38 and ctl.budget(100) == 0
    # 3 samples of version 4 and 2 of version 5 queued when version 5 goes live: 3 stale
    assert ctl.start_window(5, [4, 4, 4, 5, 5]) == 45
    with pytest.raises(ValueError, match="stale_queued=-1"):
        ctl.budget(-1)


def test_acquire_release_within_window():
    ctl = StalenessController(StalenessConfig(mini_batch_size=4))  # on-policy: 4 per window
    assert ctl.acquire(3) == 3 and ctl.acquire(3) == 1 and ctl.acquire(1) == 0
    ctl.release(2)
    assert ctl.remaining == 2 and ctl.acquire(5) == 2
    assert ctl.start_window(1) == 4 and ctl.remaining == 4


def test_refund_gives_back_dropped_stale_samples_up_to_the_window_capacity():
    ctl = StalenessController(StalenessConfig(staleness_threshold=1.0, mini_batch_size=4))  # capacity 8
    assert ctl.start_window(3, [2] * 8) == 0 and ctl.acquire(2) == 0  # the stale queue used the whole budget
    assert ctl.refund(6) == 6 and ctl.acquire(8) == 6 and ctl.acquire(1) == 0  # 6 of them dropped: 6 replacements
    assert ctl.refund(5) == 2 and ctl.remaining == 2  # never beyond the capacity of a window with nothing stale
    assert ctl.refunded == 8 and ctl.refund(0) == 0
    assert ctl.start_window(4) == 8 and ctl.refunded == 8  # a new window starts from the formula
    with pytest.raises(ValueError, match="n=-1"):
        ctl.refund(-1)


@pytest.mark.parametrize(("field", "value"), [("staleness_threshold", -0.1), ("require_batches", 0),
                                              ("mini_batch_size", 0), ("trigger_parameter_sync_step", 0)])
def test_invalid_config_names_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        StalenessConfig(**{field: value})


def test_from_run_config():
    cfg = RunConfig()
    cfg.async_training.staleness_threshold = 0.5
    cfg.async_training.trigger_parameter_sync_step = 2
    cfg.dataset.train_batch_size, cfg.policy.rollout.n = 4, 2  # mini_batch_size 0 = whole batch = 8
    assert StalenessController.from_config(cfg).config.window_capacity() == 24
    cfg.policy.train.mini_batch_size = 2
    assert StalenessController.from_config(cfg).config.window_capacity() == 6
