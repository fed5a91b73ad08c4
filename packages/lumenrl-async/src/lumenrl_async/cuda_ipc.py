"""CUDA IPC weight sync: trainer and rollouter processes on one GPU share one weight buffer.

The trainer allocates, at its first publish, one CUDA tensor per weight (the snapshot dtype) and
hands them to the rollouter process once (``torch.multiprocessing`` pickles CUDA tensors as IPC
handles: the child maps the same device memory, no copy). A publish copies the new weights into
those buffers in place under a seqlock held in shared memory:

    seq = 2 * version + 1 (odd: writing) -> copy_ + synchronize -> seq = 2 * version (even: stable)

A reader takes ``s1 = seq`` (retries while odd), copies the buffers into its engine, synchronizes
and re-reads ``seq``; if it changed the copy may be torn and is redone, so an engine never keeps a
partial snapshot. Only the newest version exists (no history): a reader that falls behind skips
versions, which is what a rollouter wants.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lumenrl_async import plugin_manifest as manifest

__all__ = ["CudaIpcWeightSync", "SharedCounter"]


class SharedCounter:
    """An int64 in shared memory with a ``value`` attribute, like ``multiprocessing.Value("q")``, but
    picklable through any ``torch.multiprocessing`` channel (a queue, a pipe's ``send``), not only as a
    spawn argument: its storage is a shared-memory tensor, which torch's reductions pass by handle. A
    rollouter process spawned before the first publish receives it in its start message.
    An aligned 8-byte load or store is one instruction on the hosts torch supports: no torn reads."""

    def __init__(self, value: int = -1) -> None:
        self._cell = torch.full((1,), int(value), dtype=torch.int64).share_memory_()

    @property
    def value(self) -> int:
        return int(self._cell[0])

    @value.setter
    def value(self, v: int) -> None:
        self._cell[0] = int(v)


class CudaIpcWeightSync:
    """Writer in the trainer process; ``reader_handle()`` is what the rollouter process receives."""

    capabilities = manifest.CUDA_IPC.capabilities

    def __init__(self, seq: Any = None) -> None:
        self.buffers: dict[str, torch.Tensor] | None = None
        self.seq = seq  # a SharedCounter, made at the first publish
        self._version: int | None = None

    @classmethod
    def probe(cls) -> str | None:
        return manifest.CUDA_IPC.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> CudaIpcWeightSync:
        return cls()

    # ------------------------------------------------------------------ writer
    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if self._version is not None and version <= self._version:
            raise ValueError(f"version={version} must be greater than the last published version {self._version}")
        if self.seq is None:
            self.seq = SharedCounter(-1)
        first = self.buffers is None
        if first:
            self.buffers = {}
        self.seq.value = 2 * int(version) + 1  # odd: a write is in progress
        for name in named_tensors:
            src = named_tensors[name]
            if first:
                self.buffers[name] = torch.empty_like(src, device="cuda").contiguous()
            self.buffers[name].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        self.seq.value = 2 * int(version)
        self._version = int(version)

    def latest_version(self) -> int | None:
        value = int(self.seq.value) if self.seq is not None else -1
        return None if value < 0 else value // 2

    def reader_handle(self) -> dict[str, Any]:
        """Picklable through ``torch.multiprocessing`` (spawn args or a queue): IPC handles + seqlock."""
        if self.buffers is None:
            raise RuntimeError("publish once before handing the buffers to a reader")
        return {"buffers": self.buffers, "seq": self.seq}

    @classmethod
    def reader(cls, handle: Mapping[str, Any], *, device: Any = None) -> CudaIpcReader:
        """The reading side in the rollouter process (the buffers' device is the writer's GPU)."""
        return CudaIpcReader(handle)

    # ------------------------------------------------------------------ reader
    @staticmethod
    def read(handle: Mapping[str, Any], apply: Callable[[dict[str, torch.Tensor], int], Any],
             *, timeout: float = 30.0) -> int | None:
        """Run ``apply(buffers, version)`` on a stable snapshot (retried if a write overlapped);
        returns the version applied, None if nothing is published."""
        seq, deadline = handle["seq"], time.monotonic() + timeout
        while time.monotonic() < deadline:
            s1 = int(seq.value)
            if s1 < 0:
                return None
            if s1 % 2:
                time.sleep(0.0005)
                continue
            apply(handle["buffers"], s1 // 2)
            torch.cuda.synchronize()
            if int(seq.value) == s1:
                return s1 // 2
        raise TimeoutError("CudaIpcWeightSync.read: no stable snapshot within the timeout")


class CudaIpcReader:
    """The rollouter's view: ``latest_version()`` and ``load_into(engine)`` (FP8 engines requantize)."""

    def __init__(self, handle: Mapping[str, Any]) -> None:
        self.handle = handle

    def latest_version(self) -> int | None:
        value = int(self.handle["seq"].value)
        return None if value < 0 else value // 2

    def load_into(self, engine: Any) -> int | None:
        newest = self.latest_version()
        if newest is None:
            return None
        if newest > int(getattr(engine, "weight_version", -1)):
            CudaIpcWeightSync.read(self.handle, lambda tensors, v: engine.update_weights(tensors, v))
        return int(engine.weight_version)
