"""Atomic files and owned CPU tensor copies, shared by every package that hands tensors on.

``atomic_write`` writes through a temporary file in the destination's folder and ``os.replace``s
it into place (atomic on POSIX), so a reader sees the old file or the complete new one, never a
partial one; with ``fsync`` the bytes are on disk before the rename. ``cpu_copies`` detaches
tensors into contiguous CPU copies that own their memory, so later in-place writes by the
producer (an optimizer step) do not leak into what was handed on.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

__all__ = ["atomic_write", "atomic_write_text", "cpu_copies"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None], *, fsync: bool = True) -> None:
    """Call ``write(tmp)`` on a temporary path next to ``path``, then move it onto ``path``.

    The temporary file is removed if ``write`` (or the rename) fails.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text), fsync=fsync)


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies owning their memory (tied tensors become separate copies)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
