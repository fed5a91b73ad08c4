"""Mooncake transfer engine (``mooncake-transfer-engine``): hidden states pulled over TCP or RDMA.

Pull model over Mooncake's public ``mooncake.engine.TransferEngine`` API:

- ``put(key, tensors)``: serialize to safetensors bytes, copy them into a Mooncake managed
  buffer (``allocate_managed_buffer`` + ``write_bytes_to_buffer``) and publish
  ``{session, addr, length}`` for the key in an index directory (atomic JSON file per key; on
  one machine a temp dir, across nodes a shared filesystem).
- ``get(key)``: read the index entry, allocate a local managed buffer and
  ``transfer_sync_read`` the bytes from the producer's session, then deserialize.

The producer's buffers stay alive until ``delete`` / a new ``put`` of the same key / ``close``.
With ``metadata_server="P2PHANDSHAKE"`` no etcd or metadata service is needed.

Index directory: ``index_dir / namespace`` (no ``index_dir``: ``lumenrl_mooncake_<namespace>`` in the
system temp dir), so runs sharing an ``index_dir`` under different namespaces never see each other's
keys; producer and consumer pass the same pair (:meth:`MooncakeTransferEngine.index_path`).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lumenrl_core.storage import atomic_write_text, cpu_copies
from lumenrl_sddd import plugin_manifest as manifest
from lumenrl_sddd._util import namespace_of
from lumenrl_sddd.plugin_manifest import MOONCAKE_API

__all__ = ["MooncakeTransferEngine", "MOONCAKE_API"]

_NAMESPACE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


class MooncakeTransferEngine:
    """Key -> tensors through Mooncake; producer and consumer each create one (same ``index_dir`` and
    ``namespace``)."""

    capabilities = manifest.MOONCAKE.capabilities

    def __init__(
        self,
        *,
        index_dir: str | Path | None = None,
        namespace: str = "lumenrl",
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        index = self.index_path(index_dir, namespace)  # arguments checked before the availability
        reason = self.probe()
        if reason:
            raise RuntimeError(f"MooncakeTransferEngine unavailable: {reason}")
        from mooncake.engine import TransferEngine

        self.namespace = namespace
        self.index_dir = index
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self._engine = TransferEngine()
        rc = self._engine.initialize(local_hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize({local_hostname!r}, {metadata_server!r}, "
                               f"{protocol!r}) failed with code {rc}")
        self.session = f"{local_hostname}:{self._engine.get_rpc_port()}"
        self._owned: dict[str, tuple[int, int]] = {}  # key -> (addr, length) of our buffers
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        return manifest.MOONCAKE.unavailable_reason()

    @staticmethod
    def index_path(index_dir: str | Path | None, namespace: str) -> Path:
        """Where the key index of ``namespace`` lives: ``index_dir / namespace``; with no ``index_dir``,
        ``lumenrl_mooncake_<namespace>`` in the system temp dir. ``namespace`` is one path component."""
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"MooncakeTransferEngine: namespace={namespace!r}; expected 1-128 characters from "
                             "[A-Za-z0-9_.-], not starting with '.'")
        if index_dir is None:
            return Path(tempfile.gettempdir()) / f"lumenrl_mooncake_{namespace}"
        return Path(index_dir) / namespace

    @classmethod
    def from_config(cls, run_config: Any) -> MooncakeTransferEngine:
        """Index at ``trainer.output_dir/mooncake_index/<namespace_of(run_config)>``."""
        namespace = namespace_of(run_config)
        return cls(index_dir=Path(run_config.trainer.output_dir) / "mooncake_index", namespace=namespace)

    def _index(self, key: str) -> Path:
        return self.index_dir / f"{hashlib.sha1(key.encode()).hexdigest()}.json"

    def _alloc(self, length: int) -> int:
        addr = self._engine.allocate_managed_buffer(length)
        if not addr:
            raise MemoryError(f"mooncake allocate_managed_buffer({length}) failed")
        return addr

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        payload = st_save(cpu_copies(tensors))
        addr = self._alloc(len(payload))
        rc = self._engine.write_bytes_to_buffer(addr, payload, len(payload))
        if rc != 0:
            self._engine.free_managed_buffer(addr, len(payload))
            raise RuntimeError(f"mooncake write_bytes_to_buffer failed with code {rc} (key {key!r})")
        entry = {"key": key, "session": self.session, "addr": addr, "length": len(payload)}
        atomic_write_text(self._index(key), json.dumps(entry), fsync=False)  # ephemeral: no disk round trip
        with self._lock:
            old = self._owned.pop(key, None)
            self._owned[key] = (addr, len(payload))
        if old is not None:
            self._engine.free_managed_buffer(*old)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        try:
            entry = json.loads(self._index(key).read_text())
        except FileNotFoundError:
            raise KeyError(f"transfer key {key!r} not found in mooncake index {self.index_dir}") from None
        length = int(entry["length"])
        local = self._alloc(length)
        try:
            rc = self._engine.transfer_sync_read(entry["session"], local, int(entry["addr"]), length)
            if rc != 0:
                raise RuntimeError(f"mooncake transfer_sync_read from {entry['session']} failed with code {rc} "
                                   f"(key {key!r})")
            payload = self._engine.read_bytes_from_buffer(local, length)
        finally:
            self._engine.free_managed_buffer(local, length)
        return st_load(bytes(payload))

    def pop(self, key: str) -> dict[str, torch.Tensor]:
        tensors = self.get(key)
        self.delete(key)
        return tensors

    def delete(self, key: str) -> None:
        """Remove the key from the index; free its buffer if this engine wrote it."""
        self._index(key).unlink(missing_ok=True)
        with self._lock:
            owned = self._owned.pop(key, None)
        if owned is not None:
            self._engine.free_managed_buffer(*owned)

    def close(self) -> None:
        """Free every buffer this engine wrote and drop those keys from the index."""
        with self._lock:
            keys = list(self._owned)
        for key in keys:
            self.delete(key)
