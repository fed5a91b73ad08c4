"""lumenrl-async's weight syncs as :class:`~lumenrl_core.plugins.PluginSpec`: the entry points in
``pyproject.toml`` name these, so listing and planning them imports no torch (``cuda_ipc``'s probe
does, and only when a config names it). Each class reads its ``capabilities`` from here and its
``probe()`` returns its spec's ``unavailable_reason()``.
"""

from __future__ import annotations

from lumenrl_core.plugins import PluginSpec

__all__ = ["INPROCESS", "FILESYSTEM", "CUDA_IPC"]


def _cuda_ipc_reason() -> str | None:
    """CUDA IPC shares device memory between processes: it needs a GPU visible to torch."""
    import torch

    return None if torch.cuda.is_available() else "CUDA IPC needs a CUDA device"


# lumenrl.weight_syncs
INPROCESS = PluginSpec("lumenrl_async.weight_sync:InProcessWeightSync", {"in_process", "versioned"})
FILESYSTEM = PluginSpec("lumenrl_async.weight_sync:FilesystemWeightSync",
                        {"cross_process", "cross_node", "versioned", "checksum"})
CUDA_IPC = PluginSpec("lumenrl_async.cuda_ipc:CudaIpcWeightSync", {"cross_process", "versioned", "cuda_ipc"},
                      probe=_cuda_ipc_reason)
