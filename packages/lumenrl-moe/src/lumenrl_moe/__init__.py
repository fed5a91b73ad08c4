"""MoE rollout routing replay (R3) for LumenRL: route arrays, router math, routing metrics.

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_moe`` and
its torch-free :mod:`lumenrl_moe.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

from lumenrl_core.lazy import lazy_exports
from lumenrl_moe.__about__ import __version__ as __version__

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "routes": ("validate_routes", "pad_routes"),
    "metrics": (
        "route_flip_fraction", "expert_load_imbalance", "routing_step_metrics", "extreme_token_fraction",
        "extreme_token_fraction_from_log_probs", "train_infer_kl",
    ),
    "routers": ("SoftmaxTopKRouter", "SigmoidGroupTopKRouter"),
    "replay": ("REPLAY_MODES", "RecordTarget", "RouteController", "install_routing", "uninstall_routing", "moe_blocks"),
}
__all__, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
