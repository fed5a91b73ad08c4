"""Routing arrays for R3 (rollout routing replay).

A route array holds, per token and MoE layer, the top-k expert indices chosen at inference:
shape ``(..., L_moe, k)`` with one row of ``k`` experts per token and layer (the batch layout is
``routed_experts`` (B, P+T, L_moe, k) int). Within a row no expert may repeat, including pad
rows (a replayed top-k with a duplicate expert would double-count it); pad rows use 0..k-1.
"""

from __future__ import annotations

import torch

__all__ = ["validate_routes", "pad_routes"]


def _check_shape(routes: torch.Tensor, num_tokens: int | None, num_layers: int | None, top_k: int | None) -> None:
    if routes.dim() < 3:
        raise ValueError(f"routes.shape={tuple(routes.shape)}: expected (..., tokens, L_moe, k) with >= 3 dims")
    tokens, layers, k = routes.shape[-3:]
    for name, want, have in (("num_tokens", num_tokens, tokens), ("num_layers", num_layers, layers),
                             ("top_k", top_k, k)):
        if want is not None and want != have:
            raise ValueError(f"routes.shape={tuple(routes.shape)}: {name}={have}, expected {want}")


def validate_routes(
    routes: torch.Tensor,
    *,
    num_experts: int | None = None,
    num_tokens: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
) -> None:
    """Raise ``ValueError`` unless ``routes`` (..., tokens, L_moe, k) is a valid route array.

    Checks: integer dtype; the expected number of token rows, layers and k (when given); expert
    ids in ``[0, num_experts)`` (when given); no expert repeated within a row.
    """
    if routes.dtype.is_floating_point or routes.dtype == torch.bool or routes.is_complex():
        raise ValueError(f"routes.dtype={routes.dtype}: expected an integer dtype (expert indices)")
    _check_shape(routes, num_tokens, num_layers, top_k)
    if routes.numel() == 0:
        return
    low, high = int(routes.min()), int(routes.max())
    if low < 0 or (num_experts is not None and high >= num_experts):
        bound = f"[0, {num_experts})" if num_experts is not None else ">= 0"
        raise ValueError(f"routes hold expert ids in [{low}, {high}]; allowed: {bound}")
    ordered = routes.sort(dim=-1).values  # (..., k)
    repeats = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)  # (..., tokens, L_moe)
    if bool(repeats.any()):
        where = [int(i) for i in repeats.nonzero()[0].tolist()]
        raise ValueError(f"routes repeat an expert within a row at index {where} (row {routes[tuple(where)].tolist()}); "
                         "each row must list k distinct experts")


def pad_routes(routes: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Right-pad ``routes`` (tokens, L_moe, k) to ``num_tokens`` rows with the valid row 0..k-1."""
    tokens, layers, k = routes.shape[-3:]
    if num_tokens < tokens:
        raise ValueError(f"num_tokens={num_tokens}: smaller than the {tokens} rows already present")
    pad = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(*routes.shape[:-3], num_tokens - tokens,
                                                                           layers, k)
    return torch.cat([routes, pad], dim=-3)
