"""MORI transfer engine (ROCm's ``mori`` I/O engine): registered so configs can name it; unavailable
without ROCm. MORI moves GPU buffers over RDMA/XGMI and has no CPU path, so ``probe`` reports why
it cannot run here and construction refuses with that reason. A ROCm build would pull tensors with
MORI's I/O engine the way :class:`~lumenrl_sddd.mooncake_engine.MooncakeTransferEngine` does with Mooncake.
"""

from __future__ import annotations

from typing import Any

from lumenrl_sddd import plugin_manifest as manifest

__all__ = ["MoriTransferEngine"]


class MoriTransferEngine:
    capabilities = manifest.MORI.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.MORI.unavailable_reason()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"MoriTransferEngine unavailable: {self.probe()}")

    @classmethod
    def from_config(cls, run_config: Any) -> MoriTransferEngine:
        return cls()
