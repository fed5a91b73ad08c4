"""The bounded sample queue between the rollouter and the trainer, with explicit accounting.

Unit: a :class:`SampleGroup` is one GRPO group (the ``n`` responses of one prompt), queued and
taken whole, so the trainer never sees a partial group. Each group carries, per sample, the
oldest policy version any of its tokens was generated under (``versions``) and the newest version
among its tokens (``newest_version``: the weights that finished it); a partial rollout that spanned
a weight sync carries its per-token versions in the payload (``token_versions``).

A group's lag (weight syncs behind the consumer's version) counts from one of two versions
(``lag_from`` of :meth:`SampleQueue.get`): ``"start"``, its oldest token (the strict measure: a
group resumed across more syncs than the bound allows is dropped however fresh its last tokens
are), or ``"finish"``, the version that finished it (a resumed group is as fresh as the weights
that completed it; its older tokens stay off-policy, recorded per token). The two agree for a
group generated under one version.

Accounting (samples = sequences), checked by :meth:`SampleQueue.check` and asserted by the
trainer at every step::

    produced == consumed + sum(dropped[reason]) + queued + in_transit

``produced`` counts what the producer finished; ``in_transit`` what it finished but the queue
has not received yet (cross-process transport; 0 in one process). A sample leaves the queue
exactly once, either consumed (handed to the trainer) or dropped with a reason
(``stale``: older than ``max_lag`` syncs when taken; ``rollouter_crash``; ``restart``:
in flight at a checkpoint; ``filtered``: dynamic sampling). Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LAG_FROM", "SampleGroup", "SampleQueue", "AccountingError", "lag_of", "versions_metrics"]

LAG_FROM = ("start", "finish")  # a group's lag counts from its oldest token's version, or the version that finished it


def _checked(lag_from: str) -> str:
    if lag_from not in LAG_FROM:
        raise ValueError(f"lag_from={lag_from!r} is not allowed; allowed: {', '.join(LAG_FROM)}")
    return lag_from


class AccountingError(AssertionError):
    """The queue's ledger does not balance: a sample was lost or counted twice."""


def lag_of(current_version: int, sample_version: int, sync_step: int = 1) -> int:
    """Weight syncs between ``sample_version`` and ``current_version`` (versions are trainer steps,
    published every ``sync_step`` steps): ``ceil((current - sample) / sync_step)``, at least 0."""
    return max(0, math.ceil((int(current_version) - int(sample_version)) / max(1, int(sync_step))))


@dataclass(kw_only=True, slots=True)
class SampleGroup:
    uid: str  # the group's id (``uid`` column of its rows)
    payload: Any  # a DataProto of the group's rows (or its bytes across processes)
    versions: tuple[int, ...]  # per sample: oldest policy version among its tokens
    newest_version: int = -1  # newest version among its tokens (> oldest: a partial rollout)
    meta: dict[str, Any] = field(default_factory=dict)  # producer notes (round, loader state, ...)
    created: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.versions)

    @property
    def oldest(self) -> int:
        return min(self.versions)

    @property
    def finished(self) -> int:
        """The version that finished the group: its newest token's (its oldest, when not recorded)."""
        return max(self.newest_version, max(self.versions))

    def lag(self, current_version: int, sync_step: int = 1, lag_from: str = "start") -> int:
        """Weight syncs between the group's ``lag_from`` version (see :data:`LAG_FROM`) and ``current_version``."""
        return lag_of(current_version, self.oldest if _checked(lag_from) == "start" else self.finished, sync_step)


class SampleQueue:
    """Bounded FIFO of :class:`SampleGroup` (capacity in samples; 0 = unbounded)."""

    def __init__(self, capacity: int = 0, *, sync_step: int = 1) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}: expected >= 0 (0 = unbounded)")
        self.capacity = capacity
        self.sync_step = sync_step
        self._groups: deque[SampleGroup] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.produced = 0  # finished by the producer (including in transit)
        self.received = 0  # entered this queue
        self.consumed = 0
        self.dropped: Counter[str] = Counter()
        self.queued = 0
        self.consumed_uids: set[str] = set()
        self.last_meta: dict[str, Any] = {}  # meta of the newest group received (resume point)

    # ------------------------------------------------------------------ producer side
    def note_produced(self, samples: int) -> None:
        """A remote producer finished ``samples`` that are on their way (cross-process)."""
        with self._cond:
            self.produced += samples

    def put(self, group: SampleGroup, *, timeout: float | None = None, counted: bool = False) -> bool:
        """Queue ``group`` (blocks while full); False if closed or timed out (then nothing counted).
        ``counted``: its production was already reported through :meth:`note_produced`."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or self._fits(group.size), timeout)
            if not ok or self._closed:
                return False
            if not counted:
                self.produced += group.size
            self.received += group.size
            self.queued += group.size
            self.last_meta = group.meta
            self._groups.append(group)
            self._cond.notify_all()
            return True

    def _fits(self, size: int) -> bool:
        return self.capacity == 0 or self.queued == 0 or self.queued + size <= self.capacity

    # ------------------------------------------------------------------ consumer side
    def get(
        self, num_groups: int, *, current_version: int, max_lag: int | None = None, timeout: float | None = None,
        alive: Any = None, lag_from: str = "start",
    ) -> list[SampleGroup] | None:
        """Take ``num_groups`` whole groups, FIFO; groups more than ``max_lag`` syncs behind
        ``current_version`` (counted from their ``lag_from`` version, :data:`LAG_FROM`) are dropped as
        ``stale`` on the way. None if closed/timed out first (groups already taken stay taken: they are
        returned on a later call)."""
        _checked(lag_from)
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[SampleGroup] = []
        with self._cond:
            while len(taken) < num_groups:
                while self._groups and len(taken) < num_groups:
                    group = self._groups.popleft()
                    self.queued -= group.size
                    if max_lag is not None and group.lag(current_version, self.sync_step, lag_from) > max_lag:
                        self.dropped["stale"] += group.size
                    else:
                        taken.append(group)
                    self._cond.notify_all()
                if len(taken) >= num_groups:
                    break
                if self._closed or (alive is not None and not alive()):
                    self._requeue(taken)
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._requeue(taken)
                    return None
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            for group in taken:
                if group.uid in self.consumed_uids:
                    raise AccountingError(f"group {group.uid!r} consumed twice")
                self.consumed_uids.add(group.uid)
                self.consumed += group.size
            return taken

    def _requeue(self, groups: list[SampleGroup]) -> None:
        for group in reversed(groups):
            self._groups.appendleft(group)
            self.queued += group.size

    def drop(self, samples: int, reason: str, *, counted: bool = False) -> None:
        """Count ``samples`` finished but never queued (filtered, or arriving after close);
        ``counted``: their production was already reported through :meth:`note_produced`."""
        with self._cond:
            if not counted:
                self.produced += samples
            self.received += samples
            self.dropped[reason] += samples

    def drop_in_transit(self, reason: str) -> int:
        """Produced but never received (a crashed producer's lost messages): dropped with ``reason``."""
        with self._cond:
            lost = self.produced - self.received
            if lost > 0:
                self.dropped[reason] += lost
                self.received += lost  # settled here: no longer in transit
            return max(0, lost)

    def drop_queued(self, reason: str) -> int:
        """Drop everything still queued with ``reason`` (shutdown, restart); returns samples dropped."""
        with self._cond:
            n = sum(g.size for g in self._groups)
            self._groups.clear()
            self.queued = 0
            if n:
                self.dropped[reason] += n
            self._cond.notify_all()
            return n

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ accounting
    @property
    def in_transit(self) -> int:
        """Finished by the producer, not yet settled here (``received`` counts settled samples)."""
        return self.produced - self.received

    @property
    def taken(self) -> int:
        """Samples that left the queue (consumed or dropped)."""
        return self.ledger()[0]

    def ledger(self) -> tuple[int, int]:
        """``(taken, stale)`` read together: samples that left the queue, and how many of them were
        dropped as ``stale`` (what a producer needs to keep its staleness budget exact)."""
        with self._cond:
            return self.consumed + sum(self.dropped.values()), self.dropped["stale"]

    def queued_versions(self) -> list[int]:
        with self._cond:
            return [v for g in self._groups for v in g.versions]

    def check(self) -> None:
        """Raise :class:`AccountingError` unless the ledger balances."""
        with self._cond:
            dropped = sum(self.dropped.values())
            queued = sum(g.size for g in self._groups)
            if queued != self.queued:
                raise AccountingError(f"queued counter {self.queued} != {queued} samples in the queue")
            rhs = self.consumed + dropped + self.queued + self.in_transit
            if self.produced != rhs or self.in_transit < 0:
                raise AccountingError(
                    f"produced {self.produced} != consumed {self.consumed} + dropped {dropped} + queued "
                    f"{self.queued} + in transit {self.in_transit}")

    def metrics(self) -> dict[str, float]:
        with self._cond:
            out = {
                "async/produced": float(self.produced),
                "async/consumed": float(self.consumed),
                "async/queue_depth": float(self.queued),
                "async/in_transit": float(self.in_transit),
                "async/dropped": float(sum(self.dropped.values())),
            }
            out.update({f"async/dropped_{k}": float(v) for k, v in self.dropped.items()})
            return out

    def state_dict(self) -> dict[str, Any]:
        """The ledger (not the queued payloads: at a restart they are dropped as ``restart``)."""
        with self._cond:
            return {"produced": self.produced, "received": self.received, "consumed": self.consumed,
                    "dropped": dict(self.dropped), "queued": self.queued,
                    "consumed_uids": sorted(self.consumed_uids)}

    def load_state_dict(self, state: dict[str, Any], *, restart_reason: str = "restart") -> None:
        """Restore a ledger saved by :meth:`state_dict`; what was queued or in transit then is dropped."""
        with self._cond:
            if self._groups or self.produced:
                raise RuntimeError("load_state_dict: the queue is not fresh")
            self.produced = int(state["produced"])
            self.consumed = int(state["consumed"])
            self.dropped = Counter({k: int(v) for k, v in state["dropped"].items()})
            self.consumed_uids = set(state.get("consumed_uids", ()))
            lost = self.produced - self.consumed - sum(self.dropped.values())
            if lost:
                self.dropped[restart_reason] += lost
            self.received = self.produced
            self.queued = 0


def versions_metrics(lags: Iterable[int], prefix: str = "async/staleness") -> dict[str, float]:
    """Mean, max and a histogram (``{prefix}_lag_{k}``: fraction of samples k syncs behind)."""
    lags = [int(x) for x in lags]
    if not lags:
        return {}
    hist = Counter(lags)
    out = {f"{prefix}_mean": sum(lags) / len(lags), f"{prefix}_max": float(max(lags))}
    out.update({f"{prefix}_lag_{k}": c / len(lags) for k, c in sorted(hist.items())})
    return out
