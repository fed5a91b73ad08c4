"""Speculative-decoding draft distillation (SDDD) for LumenRL: Eagle3 / DFlash drafts, teacher capture,
hidden-state transfer engines and Eagle3 export (see the package README)."""

from lumenrl_sddd.__about__ import __version__
from lumenrl_sddd.dflash import DFlashConfig, DFlashDraft
from lumenrl_sddd.eagle3 import Eagle3Config, Eagle3Draft
from lumenrl_sddd.export import export_eagle3, load_draft, load_eagle3, save_draft
from lumenrl_sddd.tcp_engine import TCPTransferEngine
from lumenrl_sddd.transfer import (
    InProcessTransferEngine,
    MooncakeTransferEngine,
    SharedMemoryTransferEngine,
    namespace_of,
)

__all__ = [
    "__version__",
    "InProcessTransferEngine",
    "SharedMemoryTransferEngine",
    "MooncakeTransferEngine",
    "TCPTransferEngine",
    "namespace_of",
    "Eagle3Config",
    "Eagle3Draft",
    "DFlashConfig",
    "DFlashDraft",
    "export_eagle3",
    "load_eagle3",
    "save_draft",
    "load_draft",
]
