"""MoE rollout routing replay (R3) for LumenRL: route arrays, router math, routing metrics.

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_moe`` and
its torch-free :mod:`lumenrl_moe.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lumenrl_moe.__about__ import __version__

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "routes": ("validate_routes", "pad_routes"),
    "metrics": (
        "route_flip_fraction", "expert_load_imbalance", "routing_step_metrics", "extreme_token_fraction",
        "extreme_token_fraction_from_log_probs", "train_infer_kl",
    ),
    "routers": ("SoftmaxTopKRouter", "SigmoidGroupTopKRouter"),
    "replay": ("REPLAY_MODES", "RecordTarget", "RouteController", "install_routing", "moe_blocks"),
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
