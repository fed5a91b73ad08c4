"""Speculative-decoding draft distillation (SDDD) for LumenRL; today the hidden-state transfer engines."""

from lumenrl_sddd.__about__ import __version__
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
    "namespace_of",
]
