"""R3 replay in the training backend (capability ``route_replay``).

With ``moe.r3.enabled`` the backend patches its model's MoE routers
(:func:`lumenrl_moe.install_routing`) before sharding, and every forward that has
``routed_experts`` (B, P+T, L_moe, k) in its batch (old-log-prob, reference and update passes)
replays them: :meth:`RouteReplay.set` lays the rows of the micro-batch out in the forward's
token order (packed, trimmed or padded: :func:`~lumenrl_backends.training.packing.layout_routes`)
and hands them to the controller; they stay set until the next forward, so activation
checkpointing's recompute in backward replays the same routes. ``replay_mode`` picks
``hard_assignment`` (gate weights from the live logits, router trained) or ``distribution``
(recorded probabilities ``router_probs``).

Router aux/load-balancing loss: the RL losses do not add one (HF computes it only with
``output_router_logits``, which the backend never sets), so under replay no aux term reads the
replayed assignment; the router learns only through the policy loss via the recomputed gate
weights. Expert load is reported from the recorded routes (``moe/expert_load_imbalance``).

:meth:`RouteReplay.flips` maps the controller's per-token "live router would choose a different
set" flags back to the (b, P+T) grid (``moe/route_flip_frac``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lumenrl_backends.training.packing import layout_routes, unlayout_tokens

__all__ = ["NoReplay", "RouteReplay", "ROUTE_KEYS", "route_replay"]

ROUTE_KEYS = ("routed_experts", "router_probs")


class RouteReplay:
    keys = ROUTE_KEYS  # batch columns the backend moves to the device with the model inputs

    def __init__(self, model: nn.Module, *, replay_mode: str, router: str = "") -> None:
        from lumenrl_moe import install_routing

        self.ctl = install_routing(model, replay_mode=replay_mode, router_cls=router or None)
        self._plan, self._shape, self._flips = None, (0, 0), []
        self.last_flips: torch.Tensor | None = None  # (B, P+T) bool of the last compute_log_probs

    def set(self, inputs: Mapping[str, torch.Tensor], plan: Any) -> None:
        """Replay the micro-batch's recorded routes in the next forward (laid out like its tokens)."""
        routes = inputs.get("routed_experts")
        if routes is None:
            raise KeyError("moe.r3.enabled: the batch has no 'routed_experts'; the rollout engine must record routes "
                           "(capability route_recording)")
        probs = inputs.get("router_probs")
        self.ctl.replay(layout_routes(plan, routes),
                        None if probs is None else layout_routes(plan, probs))
        self._plan, self._shape = plan, tuple(inputs["input_ids"].shape)

    def flips(self, plan: Any, shape: tuple[int, int]) -> torch.Tensor:
        """(b, P+T) bool: tokens of the last forward whose live top-k set differs from the replayed one."""
        return unlayout_tokens(plan, self.ctl.flips.to(torch.uint8), shape).bool()

    def collect(self) -> None:
        """Keep the last forward's flips (one micro-batch of an inference pass)."""
        self._flips.append(self.flips(self._plan, self._shape).to(torch.uint8))

    def finish(self, gather: Callable, rows: int, device: torch.device) -> None:
        """``last_flips`` of the whole pass: micro-batches concatenated, gathered over ranks, cut to ``rows``."""
        self.last_flips = gather(torch.cat(self._flips))[:rows].to(device).bool()
        self._flips = []


class NoReplay:
    """R3 off: the backend's calls are no-ops."""

    keys: tuple[str, ...] = ()
    last_flips = None

    def set(self, inputs: Any, plan: Any) -> None:
        pass

    def collect(self) -> None:
        pass

    def finish(self, gather: Callable, rows: int, device: torch.device) -> None:
        pass


def route_replay(model: nn.Module, r3: Any | None) -> RouteReplay | NoReplay:
    """The backend's replay for ``moe.r3`` (patches ``model``'s routers when enabled)."""
    if r3 is None or not r3.enabled:
        return NoReplay()
    return RouteReplay(model, replay_mode=r3.replay_mode, router=r3.router)
