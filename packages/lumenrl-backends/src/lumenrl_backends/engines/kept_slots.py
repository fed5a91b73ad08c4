"""Slots an interrupted native-engine call leaves to its continuation (see :mod:`~lumenrl_backends.engines.native`).

An unfinished row of an interrupted call keeps its slot (KV cache and decode state) until the next call. A row of
that call that continues it exactly (same sampling seed, prompt + response so far, sampler settings, and weights
unless ``keep_on_update``) resumes in the slot with no prefill, bit for bit the uninterrupted sequence; every other
kept slot is freed then. This is what makes an async rollouter's refill (interrupt while the batch runs under-full,
continue the leftover beside fresh rows) cost the fresh rows' prefill only, not the leftover's again.

The engine frees them all at a weight update (their caches hold the old weights' keys and values: those rows are
prefilled under the new ones), unless ``keep_on_update`` is set (``async_training.resume_kv=keep``, an in-flight
update: the rows continue on the old weights' cache, their new tokens computed by the new weights) and no FP8 KV
cache is recalibrated at the update (its kept codes would be read at new scales). Calls with R3 route recording
or a speculative draft keep nothing: they free every slot at their end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lumenrl_backends.engines.requests import Request
from lumenrl_backends.engines.sampling import SamplingParams
from lumenrl_backends.engines.slots import SlotState

__all__ = ["KeptSlots"]


@dataclass(frozen=True, slots=True)
class _Kept:
    """What an interrupted row left in its slot: the continuation that may reclaim it."""

    seed: int
    context: tuple[int, ...]  # prompt + response so far; the cache holds all but the last token
    version: int  # the engine's weights
    sampling: tuple[float, int, float]  # temperature, top_k, top_p of the slot's sampler


def _sampler(params: SamplingParams) -> tuple[float, int, float]:
    return float(params.temperature), int(params.top_k), float(params.top_p)


class KeptSlots:
    """The kept rows of one engine's :class:`SlotState`, and counts of what became of them (``counts``: rows kept,
    reclaimed, of those reclaimed after a weight update, and freed unused)."""

    def __init__(self, slots: SlotState) -> None:
        self.slots = slots
        self.keep_on_update = False
        self.rows: dict[int, _Kept] = {}
        self.counts = {"kept": 0, "reclaimed": 0, "across_updates": 0, "freed": 0}

    def keep(self, active: dict[int, Request], params: SamplingParams, version: int) -> None:
        """``active``'s slots stay taken for their continuation (their state: each row's last recorded token)."""
        sampler = _sampler(params)
        for slot, request in active.items():
            self.rows[slot] = _Kept(seed=int(request.seed), context=tuple(request.context), version=int(version),
                                    sampling=sampler)
        self.counts["kept"] += len(active)

    def reclaim(self, requests: list[Request], params: SamplingParams, version: int) -> dict[int, Any]:
        """Slot -> request for the requests that continue a kept row exactly; every other kept slot is freed."""
        kept, self.rows = self.rows, {}
        if not kept:
            return {}
        sampler = _sampler(params)
        waiting = {(k.seed, k.context): slot for slot, k in kept.items()  # other weights: kept by keep_on_update
                   if (k.version == version or self.keep_on_update) and k.sampling == sampler}
        active: dict[int, Request] = {}
        for request in requests:
            if request.done or not request.response:
                continue
            slot = waiting.pop((int(request.seed), tuple(request.context)), None)
            if slot is not None:
                active[slot] = request
                self.counts["across_updates"] += kept[slot].version != version
        unused = [slot for slot in kept if slot not in active]
        if unused:
            self.slots.release_many(unused)
        self.counts["reclaimed"] += len(active)
        self.counts["freed"] += len(unused)
        return active

    def free(self) -> None:
        if self.rows:
            self.counts["freed"] += len(self.rows)
            self.slots.release_many(list(self.rows))
            self.rows = {}
