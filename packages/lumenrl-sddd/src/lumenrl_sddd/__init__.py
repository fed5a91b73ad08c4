"""Speculative-decoding draft distillation (SDDD) for LumenRL: Eagle3 / DFlash drafts, teacher capture,
hidden-state transfer engines and Eagle3 export (see the package README).

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_sddd`` and
its torch-free :mod:`lumenrl_sddd.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

from lumenrl_core.lazy import lazy_exports
from lumenrl_sddd.__about__ import __version__ as __version__

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "transfer": (
        "InProcessTransferEngine", "SharedMemoryTransferEngine", "MooncakeTransferEngine", "namespace_of",
    ),
    "tcp_engine": ("TCPTransferEngine",),
    "eagle3": ("Eagle3Config", "Eagle3Draft"),
    "dflash": ("DFlashConfig", "DFlashDraft"),
    "export": ("export_eagle3", "load_eagle3", "save_draft", "load_draft"),
    "lossless": ("divergence_gaps",),
}
__all__, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
