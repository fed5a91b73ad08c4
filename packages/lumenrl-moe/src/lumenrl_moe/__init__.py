"""MoE rollout routing replay (R3) for LumenRL: route arrays, router math, routing metrics."""

from lumenrl_moe.__about__ import __version__
from lumenrl_moe.metrics import (
    expert_load_imbalance,
    extreme_token_fraction,
    extreme_token_fraction_from_log_probs,
    route_flip_fraction,
    routing_step_metrics,
    train_infer_kl,
)
from lumenrl_moe.replay import REPLAY_MODES, RecordTarget, RouteController, install_routing, moe_blocks
from lumenrl_moe.routers import SigmoidGroupTopKRouter, SoftmaxTopKRouter
from lumenrl_moe.routes import pad_routes, validate_routes

__all__ = [
    "__version__",
    "validate_routes",
    "pad_routes",
    "route_flip_fraction",
    "expert_load_imbalance",
    "routing_step_metrics",
    "extreme_token_fraction",
    "extreme_token_fraction_from_log_probs",
    "train_infer_kl",
    "SoftmaxTopKRouter",
    "SigmoidGroupTopKRouter",
    "REPLAY_MODES",
    "RecordTarget",
    "RouteController",
    "install_routing",
    "moe_blocks",
]
