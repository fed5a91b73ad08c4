"""R3 routing and training-inference mismatch metrics.

Conventions: ``logp_train``/``logp_infer`` are log-probabilities of the *sampled* tokens (B, T)
under the trainer and the inference engine; the tokens were sampled from the inference policy,
so KL(infer || train) is estimated from them without bias:

- k1 = E[log p_infer - log p_train]
- k3 = E[r - 1 - log r] with r = p_train / p_infer (non-negative, lower variance; Schulman's k3)

The extreme-token fraction F(tau) is the share of tokens with max(p_train/p_infer,
p_infer/p_train) > tau, computed in log space as |log p_train - log p_infer| > log tau.
All reductions are over ``mask`` (1 = counted token) and done in float64.
Metric names when logged: ``moe/route_flip_frac``, ``moe/extreme_token_frac``, ``moe/train_infer_kl``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["expert_load_imbalance", "routing_step_metrics", "route_flip_fraction", "extreme_token_fraction", "extreme_token_fraction_from_log_probs",
           "train_infer_kl"]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> float:
    values = values.double()
    if mask is None:
        return float(values.mean()) if values.numel() else 0.0
    mask = mask.to(torch.float64).expand_as(values)
    total = float(mask.sum())
    return float((values * mask).sum() / total) if total > 0 else 0.0


def route_flip_fraction(
    routes_a: torch.Tensor, routes_b: torch.Tensor, mask: torch.Tensor | None = None, *, per_layer: bool = False
) -> float:
    """Share of tokens whose expert *set* differs between two route arrays (..., tokens, L_moe, k).

    A token counts as flipped if any layer's set differs (order within a row is ignored);
    ``per_layer=True`` counts (token, layer) pairs instead. ``mask`` is (..., tokens).
    """
    if routes_a.shape != routes_b.shape:
        raise ValueError(f"routes_a.shape={tuple(routes_a.shape)} != routes_b.shape={tuple(routes_b.shape)}")
    differs = (routes_a.sort(dim=-1).values != routes_b.sort(dim=-1).values).any(dim=-1)  # (..., tokens, L_moe)
    if per_layer:
        return _masked_mean(differs, None if mask is None else mask.unsqueeze(-1))
    return _masked_mean(differs.any(dim=-1), mask)


def extreme_token_fraction_from_log_probs(
    logp_train: torch.Tensor, logp_infer: torch.Tensor, tau: float, mask: torch.Tensor | None = None
) -> float:
    """F(tau) from log-probabilities: share of tokens with |logp_train - logp_infer| > log(tau)."""
    if not tau > 1.0:
        raise ValueError(f"tau={tau}: expected > 1 (a ratio threshold)")
    gap = (logp_train.double() - logp_infer.double()).abs()
    return _masked_mean(gap > math.log(tau), mask)


def extreme_token_fraction(
    p_train: torch.Tensor, p_infer: torch.Tensor, tau: float, mask: torch.Tensor | None = None
) -> float:
    """F(tau): share of tokens with max(p_train/p_infer, p_infer/p_train) > tau (probabilities in (0, 1])."""
    return extreme_token_fraction_from_log_probs(p_train.double().log(), p_infer.double().log(), tau, mask)


def train_infer_kl(
    logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor | None = None, *, estimator: str = "k3"
) -> float:
    """Estimate KL(infer || train) from sampled-token log-probs (B, T): ``estimator`` "k1" or "k3"."""
    d = logp_train.double() - logp_infer.double()  # log r
    if estimator == "k1":
        return _masked_mean(-d, mask)
    if estimator == "k3":
        return _masked_mean(torch.expm1(d) - d, mask)
    raise ValueError(f"estimator={estimator!r}: allowed 'k1', 'k3'")


def expert_load_imbalance(routes: torch.Tensor, mask: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Per MoE layer max/mean expert load (L_moe,) float64 of ``routes`` (..., tokens, L_moe, k)
    over the ``mask``ed (..., tokens) rows; 1.0 = perfectly balanced, ``num_experts / k`` = one
    expert set takes every token."""
    layers, k = routes.shape[-2:]
    flat = routes.reshape(-1, layers, k).long()
    if mask is not None:
        flat = flat[mask.reshape(-1).bool()]
    if flat.shape[0] == 0:
        return torch.ones(layers, dtype=torch.float64)
    offsets = torch.arange(layers, device=flat.device)[None, :, None] * num_experts
    load = torch.bincount((flat + offsets).reshape(-1), minlength=layers * num_experts)
    load = load.view(layers, num_experts).double()
    return load.max(-1).values / load.mean(-1)


def routing_step_metrics(
    *,
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    response_mask: torch.Tensor,
    routes: torch.Tensor | None = None,
    route_mask: torch.Tensor | None = None,
    route_flips: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> dict[str, float]:
    """One RL step's ``moe/*`` metrics: train/infer KL (k3), extreme-token fractions F(2), F(5)
    from sampled-token log-probs (B, T); with the recorded ``routes`` (B, P+T, L_moe, k) and
    ``route_mask`` (B, P+T) (the fed tokens), the share of tokens whose live routes differ
    (``route_flips`` (B, P+T) bool) and the expert load imbalance (max/mean, per layer: mean and max)."""
    out = {
        "moe/train_infer_kl": train_infer_kl(logp_train, logp_infer, response_mask),
        "moe/extreme_token_frac@2": extreme_token_fraction_from_log_probs(logp_train, logp_infer, 2.0, response_mask),
        "moe/extreme_token_frac@5": extreme_token_fraction_from_log_probs(logp_train, logp_infer, 5.0, response_mask),
    }
    if route_flips is not None:
        out["moe/route_flip_frac"] = _masked_mean(route_flips, route_mask)
    if routes is not None and num_experts is not None:
        imbalance = expert_load_imbalance(routes, route_mask, num_experts)
        out["moe/expert_load_imbalance_mean"] = float(imbalance.mean())
        out["moe/expert_load_imbalance_max"] = float(imbalance.max())
    return out
