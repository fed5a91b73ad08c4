"""Staleness control for fully asynchronous RL.

Per sync window (the updates between two weight syncs) the rollouter may produce at most

    budget = floor((1 + s) * trigger_parameter_sync_step * require_batches * mini_batch_size)
             - (stale samples still queued)

samples, where ``s = staleness_threshold``. ``s = 0`` with ``trigger_parameter_sync_step = 1``
is on-policy; ``s = 0`` with a larger sync step streams off-policy; ``s > 0`` lets samples up to
one window older than the policy be trained on. Samples are sequences (responses).

A stale sample charged to a window and then dropped by the consumer (older than its lag bound
when taken) is refunded (:meth:`StalenessController.refund`): the trainer still needs a sample
in its place, and only this window can produce it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["StalenessConfig", "StalenessController"]


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    staleness_threshold: float = 0.0  # s >= 0: extra fraction of a window that may be produced ahead
    trigger_parameter_sync_step: int = 1  # trainer updates between weight syncs
    require_batches: int = 1  # mini-batches the trainer pulls per update
    mini_batch_size: int = 1  # samples (sequences) per mini-batch

    def __post_init__(self) -> None:
        if not self.staleness_threshold >= 0:
            raise ValueError(f"staleness_threshold={self.staleness_threshold}: expected >= 0")
        for name in ("trigger_parameter_sync_step", "require_batches", "mini_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected an int >= 1")

    def window_samples(self) -> int:
        """Samples the trainer consumes per sync window."""
        return self.trigger_parameter_sync_step * self.require_batches * self.mini_batch_size

    def window_capacity(self) -> int:
        """``floor((1 + s) * window_samples)``: most samples produced per window with nothing stale queued."""
        return math.floor((1.0 + self.staleness_threshold) * self.window_samples() + 1e-9)


class StalenessController:
    """Grants the rollouter its sample budget, window by window (thread-safe).

    The trainer calls :meth:`start_window` at every weight sync with the policy version now
    live and the versions of samples still queued; the rollouter calls :meth:`acquire` before
    generating and :meth:`release` for samples it abandoned.
    """

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.version = 0
        self._budget = config.window_capacity()
        self._granted = 0
        self.refunded = 0  # samples refunded over the run (stale drops replaced)

    @classmethod
    def from_config(cls, run_config: Any) -> StalenessController:
        a, policy = run_config.async_training, run_config.policy
        mini = policy.train.mini_batch_size or run_config.dataset.train_batch_size * policy.rollout.n
        return cls(StalenessConfig(
            staleness_threshold=a.staleness_threshold, trigger_parameter_sync_step=a.trigger_parameter_sync_step,
            require_batches=a.require_batches, mini_batch_size=mini))

    def budget(self, stale_queued: int) -> int:
        """The formula: window capacity minus stale samples still queued (never negative)."""
        if stale_queued < 0:
            raise ValueError(f"stale_queued={stale_queued}: expected >= 0")
        return max(0, self.config.window_capacity() - stale_queued)

    def start_window(self, version: int, queued_versions: Iterable[int] = ()) -> int:
        """New policy ``version`` is live; queued samples older than it are stale. Returns the budget."""
        stale = sum(1 for v in queued_versions if v < version)
        with self._lock:
            self.version = version
            self._budget = self.budget(stale)
            self._granted = 0
            return self._budget

    def acquire(self, n: int) -> int:
        """Ask to generate ``n`` samples; returns how many may be generated now (0 = wait for a sync)."""
        with self._lock:
            granted = max(0, min(n, self._budget - self._granted))
            self._granted += granted
            return granted

    def release(self, n: int) -> None:
        """Return ``n`` granted samples that were not produced (aborted or filtered)."""
        with self._lock:
            self._granted = max(0, self._granted - n)

    def refund(self, n: int) -> int:
        """``n`` samples charged to this window as stale were dropped by the consumer, never trained:
        the window may generate replacements (up to its full capacity). Returns the samples refunded.

        Without this a window whose budget the stale queue used up waits for a sync that needs
        exactly the samples it cannot grant."""
        if n < 0:
            raise ValueError(f"n={n}: expected >= 0")
        with self._lock:
            room = self.config.window_capacity() - self._budget
            added = min(n, max(0, room))
            self._budget += added
            self.refunded += added
            return added

    @property
    def remaining(self) -> int:
        with self._lock:
            return self._budget - self._granted
