"""Rollout-correction metrics, computed over valid (masked-in) response tokens only.

All keys are namespaced ``rollout_correction/`` and always present (a stable metric set):

- ``is_ratio_mean`` / ``is_ratio_max``: token ratio ``exp(log_ratio_t)`` (log ratio clamped to
  [-20, 20]) over valid tokens;
- ``is_weight_mean``: mean IS weight over valid *kept* tokens (1.0 when there are no weights);
- ``is_weight_p5`` / ``is_weight_p50`` / ``is_weight_p95``: quantiles of the same weights (linear
  interpolation between order statistics, as ``torch.quantile``; 1.0 when there are no weights);
- ``clipped_frac``: fraction of valid tokens whose weight was truncated (from ``clipped``);
- ``masked_frac``: fraction of valid tokens rejected by ``keep_mask``;
- ``kl_k1`` / ``kl_k3``: mean per-token k1 / k3 estimates of KL(rollout || train);
- ``extreme_token_frac``: fraction of valid tokens with ``max(r, 1/r) > tau``.

With no valid token every metric is 0.0 except the ``is_weight_*`` ones (1.0), never NaN.
"""

from __future__ import annotations

import math

import torch

from lumenrl_quant.correction.functional import kl_estimate, rollout_log_ratio

__all__ = ["IS_WEIGHT_QUANTILES", "METRIC_PREFIX", "rollout_correction_metrics"]

METRIC_PREFIX = "rollout_correction/"
IS_WEIGHT_QUANTILES = (5, 50, 95)  # percent: ``is_weight_p5`` / ``p50`` / ``p95``


def _masked_mean(values: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Float64 mean of ``values`` over ``valid`` (0 when ``count`` is 0), on the device."""
    values = values.detach().to(torch.float64)  # accumulate in float64
    return torch.where(valid, values, torch.zeros_like(values)).sum() / count.clamp(min=1)


def _masked_max(values: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    peak = torch.where(valid, values, torch.full_like(values, -math.inf)).max().to(torch.float64)
    return torch.where(count > 0, peak, torch.zeros_like(peak))


def _fraction(flags: torch.Tensor | None, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    if flags is None:
        return torch.zeros((), dtype=torch.float64, device=valid.device)
    return (flags & valid).sum().to(torch.float64) / count.clamp(min=1)


def _weight_mean(is_weights: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float64, device=kept.device)
    if is_weights is None:
        return one
    kept_count = kept.sum().to(torch.float64)
    return torch.where(kept_count > 0, _masked_mean(is_weights, kept, kept_count), one)


def _weight_quantiles(is_weights: torch.Tensor | None, kept: torch.Tensor) -> dict[str, torch.Tensor]:
    """``is_weight_p<q>`` over the kept tokens, without a host sync: the weights sorted with every
    other entry last (+inf), then the order statistics around rank ``q / 100 * (n - 1)`` interpolated."""
    one = torch.ones((), dtype=torch.float64, device=kept.device)
    if is_weights is None:
        return {f"is_weight_p{q}": one for q in IS_WEIGHT_QUANTILES}
    weights = is_weights.detach().to(torch.float64)
    ordered = torch.where(kept, weights, torch.full_like(weights, math.inf)).flatten().sort().values  # (B * T,)
    count = kept.sum()
    last = (count - 1).clamp(min=0).to(torch.float64)
    out = {}
    for q in IS_WEIGHT_QUANTILES:
        rank = last * (q / 100)
        low, high = rank.floor(), rank.ceil()
        below, above = (ordered.gather(0, r.long().reshape(1)).squeeze(0) for r in (low, high))
        value = below + (above - below) * (rank - low)
        out[f"is_weight_p{q}"] = torch.where(count > 0, value, one)
    return out


def rollout_correction_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    clipped: torch.Tensor | None = None,
    extreme_tau: float = 2.0,
) -> dict[str, float]:
    """Metrics dict for one batch; ``clipped`` is a (B, T) bool of truncated weights, if any.

    Everything is reduced on the tensors' device and read back with one host sync.
    """
    if extreme_tau < 1.0:
        raise ValueError(f"extreme_tau must be >= 1 (a ratio band max(r, 1/r) > tau); got {extreme_tau!r}")
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)  # (B, T)
    valid = mask != 0
    count = valid.sum().to(torch.float64)
    kept = valid if keep_mask is None else valid & (keep_mask != 0)
    ratio = torch.exp(log_ratio)
    metrics = {
        "is_ratio_mean": _masked_mean(ratio, valid, count),
        "is_ratio_max": _masked_max(ratio, valid, count),
        "is_weight_mean": _weight_mean(is_weights, kept),
        **_weight_quantiles(is_weights, kept),
        "clipped_frac": _fraction(clipped, valid, count),
        "masked_frac": _fraction(None if keep_mask is None else keep_mask == 0, valid, count),
        "kl_k1": _masked_mean(kl_estimate(log_ratio, "k1"), valid, count),
        "kl_k3": _masked_mean(kl_estimate(log_ratio, "k3"), valid, count),
        "extreme_token_frac": _fraction(log_ratio.abs() > math.log(extreme_tau), valid, count),
    }
    values = torch.stack(list(metrics.values())).tolist()  # the one device sync
    return {METRIC_PREFIX + key: value for key, value in zip(metrics, values, strict=True)}
