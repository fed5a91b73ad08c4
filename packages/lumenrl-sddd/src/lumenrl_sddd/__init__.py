"""Speculative-decoding draft distillation (SDDD) for LumenRL: Eagle3 / DFlash drafts, teacher capture,
hidden-state transfer engines and Eagle3 export (see the package README).

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_sddd`` and
its torch-free :mod:`lumenrl_sddd.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lumenrl_sddd.__about__ import __version__

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "transfer": (
        "InProcessTransferEngine", "SharedMemoryTransferEngine", "MooncakeTransferEngine", "namespace_of",
    ),
    "tcp_engine": ("TCPTransferEngine",),
    "eagle3": ("Eagle3Config", "Eagle3Draft"),
    "dflash": ("DFlashConfig", "DFlashDraft"),
    "export": ("export_eagle3", "load_eagle3", "save_draft", "load_draft"),
}
_MODULE_OF = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_MODULE_OF]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
