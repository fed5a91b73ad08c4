"""Transfer engines: move named tensors (teacher hidden states) from producer to consumer by key.

- :class:`InProcessTransferEngine`: a dict; teacher and trainer in one process.
- :class:`SharedMemoryTransferEngine`: one POSIX shared-memory segment per key
  (``multiprocessing.shared_memory``), usable across processes on one machine. Payload: an
  8-byte little-endian length, then the tensors in safetensors format (no pickle).
  Segments outlive the process that wrote them (so a producer may exit before the consumer
  reads); the consumer frees them with :meth:`~SharedMemoryTransferEngine.pop` /
  :meth:`~SharedMemoryTransferEngine.delete`, and :meth:`~SharedMemoryTransferEngine.close`
  frees whatever this engine wrote that is still there.
- :class:`MooncakeTransferEngine`: Mooncake (``mooncake-transfer-engine``); see
  :mod:`lumenrl_sddd.mooncake_engine`.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lumenrl_core.storage import cpu_copies
from lumenrl_sddd import plugin_manifest as manifest
from lumenrl_sddd._util import namespace_of, open_segment, unlink_segment
from lumenrl_sddd.mooncake_engine import MooncakeTransferEngine

__all__ = ["InProcessTransferEngine", "SharedMemoryTransferEngine", "MooncakeTransferEngine", "namespace_of"]

_HEADER = 8


class InProcessTransferEngine:
    """Key -> tensors in memory. ``put`` copies to CPU so later in-place writes do not leak."""

    capabilities = manifest.INPROCESS.capabilities

    def __init__(self) -> None:
        self._store: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        return manifest.INPROCESS.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> InProcessTransferEngine:
        return cls()

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        copied = cpu_copies(tensors)
        with self._lock:
            self._store[key] = copied

    def get(self, key: str) -> dict[str, torch.Tensor]:
        with self._lock:
            if key not in self._store:
                raise KeyError(f"transfer key {key!r} not found (in-process engine has {len(self._store)} keys)")
            return dict(self._store[key])

    def pop(self, key: str) -> dict[str, torch.Tensor]:
        tensors = self.get(key)
        self.delete(key)
        return tensors

    def delete(self, key: str) -> None:
        with self._lock:
            self._store.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._store)

    def close(self) -> None:
        with self._lock:
            self._store.clear()


class SharedMemoryTransferEngine:
    """Key -> tensors in POSIX shared memory, visible to every process using the same ``namespace``."""

    capabilities = manifest.SHM.capabilities

    def __init__(self, namespace: str = "lumenrl") -> None:
        if not re.fullmatch(r"[A-Za-z0-9_]{1,48}", namespace):
            raise ValueError(f"namespace={namespace!r}: expected 1-48 characters from [A-Za-z0-9_]")
        self.namespace = namespace
        self._written: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        return manifest.SHM.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> SharedMemoryTransferEngine:
        return cls(namespace_of(run_config))

    def segment_name(self, key: str) -> str:
        return f"lrl_{self.namespace}_{hashlib.sha1(key.encode()).hexdigest()[:24]}"

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        payload = st_save(cpu_copies(tensors))
        name = self.segment_name(key)
        self._unlink(name)  # replacing a key
        shm = open_segment(name, create=True, size=_HEADER + len(payload))
        try:
            shm.buf[_HEADER:_HEADER + len(payload)] = payload
            shm.buf[:_HEADER] = len(payload).to_bytes(_HEADER, "little")
        finally:
            shm.close()
        with self._lock:
            self._written.add(name)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        try:
            shm = open_segment(self.segment_name(key), create=False)
        except FileNotFoundError:
            raise KeyError(f"transfer key {key!r} not found in shared-memory namespace {self.namespace!r}") from None
        try:
            size = int.from_bytes(bytes(shm.buf[:_HEADER]), "little")
            payload = bytes(shm.buf[_HEADER:_HEADER + size])
        finally:
            shm.close()
        return st_load(payload)

    def pop(self, key: str) -> dict[str, torch.Tensor]:
        tensors = self.get(key)
        self.delete(key)
        return tensors

    def delete(self, key: str) -> None:
        self._unlink(self.segment_name(key))

    def _unlink(self, name: str) -> None:
        try:
            shm = open_segment(name, create=False)
        except FileNotFoundError:
            return
        shm.close()
        with contextlib.suppress(FileNotFoundError):  # another process unlinked it first
            unlink_segment(shm)
        with self._lock:
            self._written.discard(name)

    def close(self) -> None:
        """Free every segment this engine wrote that nobody consumed."""
        with self._lock:
            names = list(self._written)
        for name in names:
            self._unlink(name)
