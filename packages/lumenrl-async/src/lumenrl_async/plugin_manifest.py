"""lumenrl-async's weight syncs as :class:`~lumenrl_core.plugins.PluginSpec`: the entry points in
``pyproject.toml`` name these, so listing and planning them imports no torch (the probes of ``cuda_ipc`` and
``collective`` do, and only when a config names them). Each class reads its ``capabilities`` from here and its
``probe()`` returns its spec's ``unavailable_reason()``.
"""

from __future__ import annotations

from lumenrl_core.plugins import PluginSpec

__all__ = ["INPROCESS", "FILESYSTEM", "CUDA_IPC", "COLLECTIVE"]


def _cuda_ipc_reason() -> str | None:
    """CUDA IPC shares device memory between processes: it needs a GPU visible to torch."""
    import torch

    return None if torch.cuda.is_available() else "CUDA IPC needs a CUDA device"


def _collective_reason() -> str | None:
    """A broadcast group needs torch.distributed with gloo (CPU) or NCCL (CUDA)."""
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not (dist.is_gloo_available() or dist.is_nccl_available()):
        return "this torch build has neither the gloo nor the NCCL backend"
    return None


# lumenrl.weight_syncs
INPROCESS = PluginSpec("lumenrl_async.weight_sync:InProcessWeightSync", {"in_process", "versioned"})
FILESYSTEM = PluginSpec("lumenrl_async.weight_sync:FilesystemWeightSync",
                        {"cross_process", "cross_node", "versioned", "checksum"})
CUDA_IPC = PluginSpec("lumenrl_async.cuda_ipc:CudaIpcWeightSync", {"cross_process", "versioned", "cuda_ipc"},
                      probe=_cuda_ipc_reason)
COLLECTIVE = PluginSpec("lumenrl_async.collective:CollectiveWeightSync",
                        {"cross_process", "cross_node", "versioned", "collective"}, probe=_collective_reason)
