"""MORI transfer engine (ROCm's ``mori`` I/O engine): registered so configs can name it; unavailable
without ROCm. MORI moves GPU buffers over RDMA/XGMI and has no CPU path, so ``probe`` reports why
it cannot run here and construction refuses with that reason. A ROCm build would pull tensors with
MORI's I/O engine the way :class:`~lumenrl_sddd.mooncake_engine.MooncakeTransferEngine` does with Mooncake.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["MoriTransferEngine"]


class MoriTransferEngine:
    capabilities = frozenset({"cross_process", "cross_node", "rdma"})

    @classmethod
    def probe(cls) -> str | None:
        if getattr(torch.version, "hip", None) is None:
            return "MORI needs a ROCm build of torch (torch.version.hip is None) and AMD GPUs; it has no CPU path"
        if importlib.util.find_spec("mori") is None:
            return "the 'mori' package (ROCm/mori) is not installed"
        return "the MORI transfer path is not implemented yet in lumenrl-sddd (ROCm machine needed to build it)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"MoriTransferEngine unavailable: {self.probe()}")

    @classmethod
    def from_config(cls, run_config: Any) -> MoriTransferEngine:
        return cls()
