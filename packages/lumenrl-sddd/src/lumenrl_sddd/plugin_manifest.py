"""lumenrl-sddd's transfer engines and draft models as :class:`~lumenrl_core.plugins.PluginSpec`:
the entry points in ``pyproject.toml`` name these, so listing and planning them imports no torch
(``mori``'s probe does: it asks whether torch is a ROCm build). Each class reads its
``capabilities`` from here and its ``probe()`` returns its spec's ``unavailable_reason()``.
"""

from __future__ import annotations

import importlib.util
import secrets

from lumenrl_core.plugins import PluginSpec, module_probe
from lumenrl_sddd._util import open_segment, unlink_segment

__all__ = ["MOONCAKE_API", "INPROCESS", "SHM", "MOONCAKE", "TCP", "MORI", "EAGLE3", "DFLASH"]

# The public mooncake.engine API MooncakeTransferEngine uses (a namesake 'mooncake' package lacks it).
MOONCAKE_API = tuple(f"TransferEngine.{m}" for m in (
    "initialize", "get_rpc_port", "allocate_managed_buffer", "free_managed_buffer",
    "write_bytes_to_buffer", "read_bytes_from_buffer", "transfer_sync_read"))


def _shared_memory_reason() -> str | None:
    """Create and unlink a tiny POSIX shared-memory segment."""
    try:
        shm = open_segment(f"lrlprobe_{secrets.token_hex(6)}", create=True, size=8)
    except OSError as exc:
        return f"POSIX shared memory unusable here: {exc}"
    shm.close()
    unlink_segment(shm)
    return None


def _mooncake_reason() -> str | None:
    return module_probe("mooncake.engine", MOONCAKE_API, install="lumenrl-sddd[mooncake]")


def _mori_reason() -> str:
    import torch  # a ROCm build? (asked only when a config names mori, or by `lumenrl plugins`)

    if getattr(torch.version, "hip", None) is None:
        return "MORI needs a ROCm build of torch (torch.version.hip is None) and AMD GPUs; it has no CPU path"
    if importlib.util.find_spec("mori") is None:
        return "the 'mori' package (ROCm/mori) is not installed"
    return "the MORI transfer path is not implemented yet in lumenrl-sddd (ROCm machine needed to build it)"


_CROSS_NODE = {"cross_process", "cross_node"}

# lumenrl.transfer_engines
INPROCESS = PluginSpec("lumenrl_sddd.transfer:InProcessTransferEngine", {"in_process"})
SHM = PluginSpec("lumenrl_sddd.transfer:SharedMemoryTransferEngine", {"cross_process"}, probe=_shared_memory_reason)
MOONCAKE = PluginSpec("lumenrl_sddd.transfer:MooncakeTransferEngine", _CROSS_NODE | {"rdma"}, probe=_mooncake_reason)
TCP = PluginSpec("lumenrl_sddd.tcp_engine:TCPTransferEngine", _CROSS_NODE)
MORI = PluginSpec("lumenrl_sddd.mori_engine:MoriTransferEngine", _CROSS_NODE | {"rdma"}, probe=_mori_reason)

# lumenrl.draft_models
EAGLE3 = PluginSpec("lumenrl_sddd.eagle3:Eagle3Draft")
DFLASH = PluginSpec("lumenrl_sddd.dflash:DFlashDraft")
