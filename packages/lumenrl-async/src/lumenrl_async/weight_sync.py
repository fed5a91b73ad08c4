"""Weight synchronizers: the trainer publishes ``(named_tensors, version)``, rollout reads the latest.

- :class:`InProcessWeightSync` keeps detached copies in memory (trainer and engine in one process), each on
  the device its tensor is on: a CUDA tensor is copied on the device, in the publisher's stream order, so a
  publish blocks neither thread (a host copy of the weights took both a host wait and a page-locked bounce
  each way), at the cost of one extra copy of the weights in device memory.
- :class:`FilesystemWeightSync` writes a safetensors snapshot plus a JSON manifest (version,
  sha256, size) per version under a directory that readers on other processes or nodes can see.
  Every file is written to a temporary name in the same directory, fsync'ed and renamed into
  place (``os.replace`` is atomic on POSIX), and ``LATEST.json`` is switched only after the
  snapshot and its manifest are complete, so a reader never sees a partial snapshot; readers
  verify the checksum anyway. The last ``keep_last`` snapshots are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lumenrl_async import plugin_manifest as manifest
from lumenrl_core.storage import atomic_write, atomic_write_text, cpu_copies

__all__ = ["InProcessWeightSync", "FilesystemWeightSync", "SnapshotError", "LATEST", "load_newest"]

LATEST = "LATEST.json"
_CHUNK = 1 << 20


class SnapshotError(RuntimeError):
    """A snapshot on disk is missing or does not match its manifest."""


def _check_version(version: int, last: int | None) -> None:
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r}: expected a non-negative int")
    if last is not None and version <= last:
        raise ValueError(f"version={version} must be greater than the last published version {last}")


def _snapshot(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[Any, Any]]]:
    """Detached contiguous copies on each tensor's own device, and a CUDA event per device recorded after its
    copies on the current stream (a reader's stream waits for them, see :meth:`InProcessWeightSync.latest`)."""
    out, devices = {}, {}
    for name, t in tensors.items():
        if t.is_cuda:
            out[name] = t.detach().clone(memory_format=torch.contiguous_format)
            devices[t.device] = True
        else:
            out[name] = cpu_copies({name: t})[name]
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append((device, event))
    return out, events


class InProcessWeightSync:
    """Latest weights in memory; ``publish`` copies (on the tensors' own devices), so later in-place optimizer
    steps do not leak."""

    capabilities = manifest.INPROCESS.capabilities

    def __init__(self, *, copy: bool = True) -> None:
        self.copy = copy
        self._lock = threading.Lock()
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._events: list[Any] = []  # CUDA (device, event): recorded after the latest copies, publisher's stream

    @classmethod
    def probe(cls) -> str | None:
        return manifest.INPROCESS.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> InProcessWeightSync:
        return cls()

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        _check_version(version, self.latest_version())
        tensors, events = _snapshot(named_tensors) if self.copy else (dict(named_tensors), [])
        with self._lock:
            _check_version(version, self.latest_version())
            self._latest, self._events = (version, tensors), events

    def latest_version(self) -> int | None:
        return None if self._latest is None else self._latest[0]

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (version, tensors). CUDA tensors are ready for the caller's current stream (it waits for the
        publisher's copies, without blocking the host) and stay allocated until that stream's work queued so far
        is done, even once a newer publish drops them."""
        with self._lock:
            if self._latest is None:
                return None
            version, tensors = self._latest[0], dict(self._latest[1])
            events = list(self._events)
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)
        for t in tensors.values():
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
        return version, tensors

    def load_into(self, engine: Any) -> int | None:
        return load_newest(self, engine)


def load_newest(sync: Any, engine: Any) -> int | None:
    """Apply ``sync``'s newest weights if newer than the engine's (``engine.update_weights``: FP8/MX
    engines requantize there); returns the engine's version, None before anything was published."""
    newest = sync.latest_version()
    if newest is None:
        return None
    if newest > int(getattr(engine, "weight_version", -1)):
        loaded = sync.latest()
        if loaded is None:
            return None
        version, tensors = loaded
        engine.update_weights(tensors, version)
    return int(engine.weight_version)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class FilesystemWeightSync:
    """Versioned safetensors snapshots in ``root`` (a shared filesystem for multi-node runs).

    Layout: ``v00000007.safetensors``, ``v00000007.json`` (manifest) and ``LATEST.json`` (a copy of
    the newest manifest). Manifest: ``{"version", "file", "sha256", "bytes", "num_tensors", "created"}``.
    """

    capabilities = manifest.FILESYSTEM.capabilities

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int = 2, verify: bool = True) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: expected >= 1 (the latest snapshot must stay)")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.verify = verify

    @classmethod
    def probe(cls) -> str | None:
        return manifest.FILESYSTEM.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> FilesystemWeightSync:
        root = run_config.weight_sync.snapshot_dir or os.path.join(run_config.trainer.output_dir, "weight_sync")
        return cls(root)

    # ------------------------------------------------------------------ writer
    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        _check_version(version, self.latest_version())
        stem = f"v{version:08d}"
        data = self.root / f"{stem}.safetensors"
        tensors = cpu_copies(named_tensors)
        atomic_write(data, lambda tmp: save_file(tensors, str(tmp), metadata={"version": str(version)}))
        manifest = {"version": version, "file": data.name, "sha256": _sha256(data),
                    "bytes": data.stat().st_size, "num_tensors": len(named_tensors), "created": time.time()}
        text = json.dumps(manifest, indent=1)
        atomic_write_text(self.root / f"{stem}.json", text)
        atomic_write_text(self.root / LATEST, text)  # the switch: readers now see this version
        self._prune()

    def _prune(self) -> None:
        versions = self.versions()
        for old in versions[: max(0, len(versions) - self.keep_last)]:
            for suffix in (".safetensors", ".json"):
                (self.root / f"v{old:08d}{suffix}").unlink(missing_ok=True)

    # ------------------------------------------------------------------ reader
    def reader_handle(self) -> dict[str, Any]:
        """What a rollouter process needs to read these snapshots (picklable)."""
        return {"root": str(self.root)}

    @classmethod
    def reader(cls, handle: Mapping[str, Any], *, device: Any = None) -> FilesystemWeightSync:
        """The reading side in another process (``device`` unused: snapshots load to host memory)."""
        return cls(handle["root"])

    def load_into(self, engine: Any) -> int | None:
        return load_newest(self, engine)

    def versions(self) -> list[int]:
        """Versions whose manifest is on disk, oldest first."""
        found = []
        for path in self.root.glob("v*.json"):
            try:
                found.append(int(path.stem[1:]))
            except ValueError:
                continue
        return sorted(found)

    def manifest(self) -> dict[str, Any] | None:
        """The newest complete manifest, or ``None`` before the first publish."""
        try:
            return json.loads((self.root / LATEST).read_text())
        except FileNotFoundError:
            return None

    def latest_version(self) -> int | None:
        manifest = self.manifest()
        return None if manifest is None else int(manifest["version"])

    def load(self, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Tensors of the snapshot ``manifest`` describes, checksum-verified when ``verify``.

        A snapshot file is written once under its versioned name and later only pruned, so the
        one race with a writer is the file disappearing between any two steps of this read (the
        checksum pass, safetensors' own open): any failure while the file is gone afterwards is
        reported as :class:`SnapshotError` (pruned), which :meth:`latest` retries; a failure
        with the file still present is raised as is.
        """
        path = self.root / manifest["file"]
        try:
            if self.verify and _sha256(path) != manifest["sha256"]:
                raise SnapshotError(f"snapshot {path}: sha256 does not match its manifest")
            return load_file(str(path))
        except (OSError, RuntimeError) as exc:  # safetensors reports a vanished file as either
            if isinstance(exc, SnapshotError) or path.exists():
                raise
            raise SnapshotError(f"snapshot {path} of version {manifest['version']} is gone (pruned?)") from exc

    def latest(self, *, retries: int = 3) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, tensors)`` of the newest snapshot; retries if a writer pruned it meanwhile."""
        for attempt in range(retries + 1):
            manifest = self.manifest()
            if manifest is None:
                return None
            try:
                return int(manifest["version"]), self.load(manifest)
            except SnapshotError:
                if attempt == retries or self.latest_version() == manifest["version"]:
                    raise
        return None
