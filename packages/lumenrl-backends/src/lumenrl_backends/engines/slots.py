"""Device-side per-slot decode state of the native engine, in fixed-size tensors.

One entry per engine slot (S = max_batch_size). A decode step reads the first ``b`` entries
(``b`` = a batch bucket covering every occupied slot) and advances occupied ones in place, so the
step has a fixed shape per bucket. Free slots are handed out lowest-first, which keeps occupied
slots packed at the front and the bucket small.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from lumenrl_backends.engines.sampling import SamplingParams

__all__ = ["SlotState", "advance_slots", "batch_buckets"]


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch_size]


@dataclass(kw_only=True, slots=True)
class SlotState:
    tokens: torch.Tensor  # (S,) int64 next input token
    columns: torch.Tensor  # (S,) int64 cache column the next token is written to
    positions: torch.Tensor  # (S,) int64 RoPE position of the next token
    counters: torch.Tensor  # (S,) int64 response index of the token being sampled (noise counter)
    seeds: torch.Tensor  # (S,) int64
    temperature: torch.Tensor  # (S,) float32
    top_k: torch.Tensor  # (S,) int64
    top_p: torch.Tensor  # (S,) float32
    occupied: torch.Tensor  # (S,) bool
    free: list[int]  # min-heap of free slot ids
    host_columns: list[int]  # host mirror of ``columns`` (no device sync to read lengths)

    @classmethod
    def allocate(cls, slots: int, device: torch.device) -> SlotState:
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(slots, dtype=dtype, device=device)

        return cls(
            tokens=zeros(torch.int64),
            columns=zeros(torch.int64),
            positions=zeros(torch.int64),
            counters=zeros(torch.int64),
            seeds=zeros(torch.int64),
            temperature=zeros(torch.float32),
            top_k=zeros(torch.int64),
            top_p=zeros(torch.float32),
            occupied=zeros(torch.bool),
            free=list(range(slots)), host_columns=[0] * slots,
        )

    def take(self, count: int) -> list[int]:
        return [heapq.heappop(self.free) for _ in range(count)]

    def release(self, slot: int) -> None:
        self.release_many([slot])

    def release_many(self, slots: list[int]) -> None:
        """Free ``slots``: not occupied, column and position 0 on the device, column 0 in the host mirror. When
        that frees every slot (a batch whose rows all end on one step), the device state is reset by three
        whole-tensor fills, not three scalar writes per slot (each a kernel launched from the host)."""
        for slot in slots:
            self.host_columns[slot] = 0
            heapq.heappush(self.free, slot)
        if len(self.free) == len(self.host_columns):  # every slot free: free slots already hold column 0
            self.occupied.fill_(False)
            self.columns.zero_()
            self.positions.zero_()
            return
        for slot in slots:  # scalar writes: no host->device copy, nothing waits for the queued decode step
            self.occupied[slot] = False
            self.columns[slot] = 0
            self.positions[slot] = 0

    def release_all(self) -> None:
        """Free every occupied slot (the host's free list says which: no device read)."""
        free = set(self.free)
        self.release_many([slot for slot in range(len(self.host_columns)) if slot not in free])

    def admit(self, slots: torch.Tensor, seeds: list[int], params: SamplingParams) -> None:
        device = self.seeds.device
        self.seeds[slots] = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.temperature[slots] = float(params.temperature)
        self.top_k[slots] = int(params.top_k)
        self.top_p[slots] = float(params.top_p)
        self.occupied[slots] = True


def advance_slots(tokens: torch.Tensor, columns: torch.Tensor, positions: torch.Tensor, counters: torch.Tensor,
                  occupied: torch.Tensor, batch: int, sampled: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """After a decode step over slots 0..batch-1: occupied slots take their ``sampled`` token as the next input
    and advance column, position and counter by one (free slots keep theirs), in place on the (S,) state
    tensors; returns (2, batch) float64: the sampled tokens and their log-probs, for one host copy. One function
    so that the engine compiles it into one kernel (``compile="full"``)."""
    live = occupied[:batch]
    tokens[:batch].copy_(torch.where(live, sampled, tokens[:batch]))
    step = live.to(torch.int64)
    columns[:batch] += step
    positions[:batch] += step
    counters[:batch] += step
    return torch.stack([sampled.to(torch.float64), log_probs.to(torch.float64)])
