"""Route recording and replay on a live HF MoE model (R3 wiring, torch-level).

:func:`install_routing` finds every MoE block of a model (a module with a ``gate`` router of
weight (E, H) and an ``experts`` module: the transformers 5.x layout of Qwen3-MoE, Mixtral,
DeepSeek-V3 and GLM-4-MoE) and replaces its router's ``forward`` (per instance: parameter names,
weight sync and checkpoints are unchanged) by one that recomputes routing from the router
*input* with the family's router math (:mod:`lumenrl_moe.routers`), whatever the module's own
return convention is, and returns ``(logits, weights, indices)`` as the HF block expects.
Leading dense layers (``first_k_dense_replace``) have no router and get no route column;
shared experts are always on and need none: the route array's ``L_moe`` axis lists the MoE
layers in order.

The :class:`RouteController` it returns switches all patched routers between

* ``off``: the family's own routing (the model behaves as without the patch);
* ``record``: own routing, and the chosen expert ids (N, k) of MoE layer j are written into
  ``target.routes[..., j, :]`` at ``target.index`` (index tensors over the leading dims; static
  tensors, so a CUDA graph captures the writes); optionally the router probabilities (N, E);
* ``replay``: the experts come from ``replay_routes`` (N, L_moe, k) aligned with the flattened
  forward tokens; ``hard_assignment`` recomputes the gate weights from the live logits over
  those experts (differentiable: gradients reach the router), ``distribution`` takes them from
  the recorded probabilities ``replay_probs`` (N, L_moe, E) (renormalized and scaled as the
  family does). While replaying, the live router's own top-k is compared with the replayed set:
  ``flips`` (N,) bool accumulates tokens where any layer differs (``moe/route_flip_frac``).

Weight dtypes follow HF exactly (Qwen3-MoE casts the gate weights to the logits' dtype, the
others keep float32), so replaying the recorded routes reproduces the recording forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_moe.routers import SigmoidGroupTopKRouter, SoftmaxTopKRouter

__all__ = ["RecordTarget", "RouteController", "install_routing", "uninstall_routing", "moe_blocks", "router_class", "REPLAY_MODES", "SOFTMAX_FAMILIES",
           "SIGMOID_FAMILIES"]

REPLAY_MODES = ("hard_assignment", "distribution")
SOFTMAX_FAMILIES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral"})
SIGMOID_FAMILIES = frozenset({"deepseek_v3", "glm4_moe"})
_CAST_WEIGHTS = frozenset({"qwen3_moe", "qwen2_moe"})  # HF casts gate weights to the logits dtype


@dataclass(kw_only=True, slots=True)
class RecordTarget:
    """Where recorded routes go: ``routes`` (*lead, L_moe, k) int; row of token n = ``index`` [n]."""

    routes: torch.Tensor
    index: tuple[torch.Tensor, ...]  # each (N,): positions in the leading dims of ``routes``
    probs: torch.Tensor | None = None  # (*lead, L_moe, E) float32, or None

    def write(self, j: int, indices: torch.Tensor, probs: Callable[[], torch.Tensor] | None = None) -> None:
        """Routes (N, k) (and ``probs()`` (N, E) when recorded) of MoE layer ``j`` at ``index``. One
        ``index_put_`` on the whole buffer, the layer index a device tensor: under ``torch.compile`` an
        in-place write into a *view* of a graph input is functionalized into copies of the whole slice
        per layer and step, a write into the input itself stays in place."""
        layer = torch.full_like(self.index[0], j)
        self.routes.index_put_((*self.index, layer), indices.to(self.routes.dtype))
        if self.probs is not None and probs is not None:
            self.probs.index_put_((*self.index, layer), probs())


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """MoE blocks in forward order: modules holding a ``gate`` with a 2-D weight and ``experts``."""
    found = []
    for module in model.modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        weight = getattr(gate, "weight", None)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module) and isinstance(weight, torch.Tensor) \
                and weight.dim() == 2:
            found.append(module)
    return found


def _router_for(model_type: str, config: Any, gate: nn.Module, router_cls: type | None):
    if router_cls is None:
        router_cls = SigmoidGroupTopKRouter if model_type in SIGMOID_FAMILIES else \
            SoftmaxTopKRouter if model_type in SOFTMAX_FAMILIES else None
    if router_cls is SigmoidGroupTopKRouter:
        router = SigmoidGroupTopKRouter.from_model_config(config)
        router.e_score_correction_bias = getattr(gate, "e_score_correction_bias", None)
        return router
    if router_cls is SoftmaxTopKRouter:
        return SoftmaxTopKRouter.from_model_config(config)
    if router_cls is not None and hasattr(router_cls, "from_model_config"):  # a third-party router plugin
        return router_cls.from_model_config(config)
    raise ValueError(f"R3: no router math for MoE model_type={model_type!r}; supported: "
                     f"{', '.join(sorted(SOFTMAX_FAMILIES | SIGMOID_FAMILIES))}")


class RouteController:
    """Mode switch and buffers shared by the patched routers of one model (module docstring)."""

    def __init__(self, *, num_layers: int, top_k: int, num_experts: int, replay_mode: str) -> None:
        if replay_mode not in REPLAY_MODES:
            raise ValueError(f"moe.r3.replay_mode={replay_mode!r}; allowed: {', '.join(REPLAY_MODES)}")
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.replay_mode = replay_mode
        self.router_cls: type | None = None  # the router class install_routing patched in (None: built directly)
        self.mode = "off"
        self.target: RecordTarget | None = None
        self.replay_routes: torch.Tensor | None = None  # (N, L_moe, k)
        self.replay_probs: torch.Tensor | None = None  # (N, L_moe, E)
        self.flips: torch.Tensor | None = None  # (N,) bool, set while replaying

    def record(self, target: RecordTarget | None) -> None:
        """Record own routing into ``target`` (None: stop). While replaying, the replayed experts
        are written to ``target`` instead and the mode stays ``replay``."""
        if self.mode == "replay":
            self.target = target
            return
        self.mode, self.target = ("record", target) if target is not None else ("off", None)

    def replay(self, routes: torch.Tensor | None, probs: torch.Tensor | None = None) -> None:
        """Replay ``routes`` (N, L_moe, k) in every following forward (until changed); None = own routing."""
        if routes is None:
            self.mode, self.replay_routes, self.replay_probs, self.flips = "off", None, None, None
            return
        if routes.shape[-2:] != (self.num_layers, self.top_k):
            raise ValueError(f"routed_experts.shape={tuple(routes.shape)}: expected (..., {self.num_layers} MoE "
                             f"layers, top_k {self.top_k})")
        if self.replay_mode == "distribution" and probs is None:
            raise ValueError("moe.r3.replay_mode='distribution' needs the recorded router probabilities "
                             "(moe.r3.record_router_logits: true)")
        self.mode, self.replay_routes = "replay", routes.reshape(-1, self.num_layers, self.top_k)
        self.replay_probs = None if probs is None else probs.reshape(-1, self.num_layers, probs.shape[-1])
        self.flips = torch.zeros(self.replay_routes.shape[0], dtype=torch.bool, device=routes.device)

    # -------------------------------------------------------------- the patched router
    def route(self, j: int, router: Any, logits: torch.Tensor, cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k), indices (N, k) int64) of MoE layer ``j`` for ``logits`` (N, E)."""
        if self.mode != "replay":
            weights, indices = router.select(logits)
            target = self.target
            if self.mode == "record" and target is not None:
                target.write(j, indices, lambda: _probs(router, logits))
        else:
            indices = self.replay_routes[:, j].to(device=logits.device, dtype=torch.long)
            if indices.shape[0] != logits.shape[0]:
                raise ValueError(f"R3 replay: {indices.shape[0]} route rows for a forward of {logits.shape[0]} tokens")
            if self.replay_mode == "hard_assignment":
                weights = router.replay(logits, indices)
            else:
                probs = self.replay_probs[:, j].to(logits.device).float()
                weights = _weights_from_probs(router, probs, indices)
            own = router.select(logits.detach())[1]
            self.flips |= (own.sort(-1).values != indices.sort(-1).values).any(-1)
            if self.target is not None:  # the experts this forward actually used (diagnostics)
                self.target.write(j, indices)
        return (weights.to(logits.dtype) if cast else weights), indices


def _probs(router: Any, logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities (N, E) float32: softmax or sigmoid scores, as the family uses them."""
    logits = logits.detach().float()
    return torch.sigmoid(logits) if isinstance(router, SigmoidGroupTopKRouter) else torch.softmax(logits, -1)


def _weights_from_probs(router: Any, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return router._weights(probs, indices)  # the family's renormalization and scaling


def _patch(block: nn.Module, j: int, ctl: RouteController, router: Any, float_logits: bool, cast: bool) -> None:
    gate = block.gate
    sigmoid_bias = isinstance(router, SigmoidGroupTopKRouter) and hasattr(gate, "e_score_correction_bias")

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden_states.reshape(-1, gate.weight.shape[1])  # (N, H): the router input
        if sigmoid_bias:
            router.e_score_correction_bias = gate.e_score_correction_bias  # live buffer (moved by .to())
        logits = F.linear(h.float(), gate.weight.float()) if float_logits else F.linear(h, gate.weight)  # (N, E)
        weights, indices = ctl.route(j, router, logits, cast)
        return logits, weights, indices

    gate.forward = forward
    gate._lumenrl_r3 = True


def router_class(name: str) -> type | None:
    """The ``lumenrl.moe_routers`` plugin ``name`` (``moe.r3.router``); None for "" (by model type)."""
    if not name:
        return None
    from lumenrl_core.plugins import get_registry

    return get_registry().load("moe_routers", name)


def install_routing(model: nn.Module, *, replay_mode: str = "hard_assignment", router_cls: type | str | None = None
                    ) -> RouteController:
    """Patch every MoE router of ``model`` (an HF causal LM); returns its controller (also at
    ``model.lumenrl_routes``). ``router_cls``: a router class or ``lumenrl.moe_routers`` name
    overriding the choice by ``model_type``. Raises ValueError naming the model type if no MoE
    block is found or the family has no router math.

    On a model already patched the existing controller is returned with ``replay_mode`` set;
    ``router_cls`` must then be None (keep the installed routers) or the class already installed:
    another one raises ValueError (:func:`uninstall_routing` first to change it)."""
    if replay_mode not in REPLAY_MODES:
        raise ValueError(f"install_routing: replay_mode={replay_mode!r}; allowed: {', '.join(REPLAY_MODES)}")
    if isinstance(router_cls, str):
        router_cls = router_class(router_cls)
    existing = getattr(model, "lumenrl_routes", None)
    if isinstance(existing, RouteController):
        if router_cls is not None and router_cls is not existing.router_cls:
            raise ValueError(f"install_routing: router_cls={_qualname(router_cls)} on a model already patched with "
                             f"{_qualname(existing.router_cls)}; allowed: None or that class "
                             "(uninstall_routing(model) first to change it)")
        existing.replay_mode = replay_mode
        return existing
    config = model.config
    model_type = getattr(config, "model_type", "")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"R3: model_type={model_type!r} has no MoE block with a 'gate' router and 'experts' "
                         "(transformers 5.x layout); cannot record or replay routes")
    if isinstance(blocks[0].experts, nn.ModuleList):  # transformers < 5: the block routes by itself
        raise ValueError(f"R3: model_type={model_type!r} has per-expert modules and a gate returning logits only "
                         "(the transformers < 5.0 MoE layout); R3 needs transformers >= 5.13")
    if hasattr(blocks[0], "route_tokens_to_experts"):  # transformers 5.0-5.12: DeepSeek-V3 / GLM-4-MoE route in the block
        raise ValueError(f"R3: model_type={model_type!r} routes in its MoE block, its gate returns logits only "
                         "(the transformers 5.0-5.12 layout); R3 needs transformers >= 5.13")
    router = _router_for(model_type, config, blocks[0].gate, router_cls)
    num_experts = int(blocks[0].gate.weight.shape[0])
    ctl = RouteController(num_layers=len(blocks), top_k=router.top_k, num_experts=num_experts,
                          replay_mode=replay_mode)
    ctl.router_cls = router_cls if router_cls is not None else type(router)
    sigmoid = isinstance(router, SigmoidGroupTopKRouter)
    for j, block in enumerate(blocks):
        layer_router = _router_for(model_type, config, block.gate, router_cls) if sigmoid else router
        _patch(block, j, ctl, layer_router, float_logits=sigmoid, cast=model_type in _CAST_WEIGHTS)
    object.__setattr__(model, "lumenrl_routes", ctl)  # not a submodule: no state_dict entry
    return ctl


def _qualname(cls: type | None) -> str:
    return "None" if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def uninstall_routing(model: nn.Module) -> bool:
    """Undo :func:`install_routing`: every MoE router runs its model's own forward again; returns whether
    anything was installed."""
    if not isinstance(getattr(model, "lumenrl_routes", None), RouteController):
        return False
    for block in moe_blocks(model):
        if block.gate.__dict__.pop("_lumenrl_r3", False):
            block.gate.__dict__.pop("forward", None)
    object.__delattr__(model, "lumenrl_routes")
    return True
