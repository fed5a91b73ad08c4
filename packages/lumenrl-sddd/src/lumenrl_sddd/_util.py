"""Small helpers shared by the transfer engines (torch-free: the plugin manifest's probes use them)."""

from __future__ import annotations

import re
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Any

__all__ = ["namespace_of", "open_segment", "unlink_segment"]


def namespace_of(run_config: Any) -> str:
    """A shared-memory-safe namespace from the run's project and experiment names."""
    raw = f"{run_config.trainer.project_name}_{run_config.trainer.experiment_name}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw)[:48]


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Stop this process's resource tracker from unlinking the segment at exit (Python < 3.13)."""
    if sys.version_info < (3, 13):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def unlink_segment(shm: shared_memory.SharedMemory) -> None:
    """Unlink ``shm``; re-register first on Python < 3.13, since ``unlink`` unregisters it."""
    if sys.version_info < (3, 13):
        resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]
    shm.unlink()


def open_segment(name: str, *, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    """Create or attach POSIX shared memory ``name``; this process never unlinks it at exit."""
    kwargs: dict[str, Any] = {"track": False} if sys.version_info >= (3, 13) else {}
    shm = shared_memory.SharedMemory(name=name, create=create, size=size, **kwargs)
    _untrack(shm)
    return shm
