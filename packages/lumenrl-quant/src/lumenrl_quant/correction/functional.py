"""Rollout correction as pure tensor functions (TIS, MIS, Seq-MIS, KL rejection).

Design
------
The rollout engine samples with probabilities that differ slightly from the trainer's (FP8
weights, other kernels, stale weights). Every function here compares, per response token,

    log_ratio_t = clamp(old_log_probs_t - rollout_log_probs_t, -20, 20)       # (B, T)

computed in at least float32, **detached** (corrections are constants in the loss), and zero at
padding. Inputs are ``old_log_probs`` (trainer), ``rollout_log_probs`` (engine), both (B, T), and
``mask`` (B, T) with non-zero on valid response tokens. Padding never influences any result: a
sequence quantity is a sum / mean over its valid tokens only.

Outputs:

- IS weights (B, T) in the compute dtype, **zero at padding**;
- keep masks (B, T) in the dtype of ``mask``: a refinement of ``mask`` (a rejected token or
  sequence is 0, padding stays 0).

Formulas (ratio r = exp(log_ratio)):

- TIS token:     w_t = min(r_t, C)
- TIS sequence:  w_t = min(exp(sum_s log_ratio_s), C)            (same for every token of a row)
- MIS token:     keep_t = lo <= r_t <= hi
- MIS sequence:  keep_t = lo <= exp(sum_s log_ratio_s) <= hi
- MIS geometric: keep_t = lo <= exp(mean_s log_ratio_s) <= hi    (empty row: ratio 1)
- Seq-MIS:       w_t = exp(sum_s log_ratio_s), keep_t = lo <= that <= hi   (lo=0.5, hi=2)
- KL rejection:  reject a row when the mean over its valid tokens of a k-estimator of
  KL(rollout || train) exceeds a threshold. Samples come from the rollout policy, so with
  d = rollout_log_probs - old_log_probs = -log_ratio: k1 = d, k2 = d^2 / 2,
  k3 = exp(-d) + d - 1 = r - 1 - log r (unbiased k1/k3; k2 is the low-bias squared form).

Sequence sums of log ratios are clamped to [-20, 20] again before ``exp`` (no float32 overflow);
this never changes a result whose cap or band lies inside [e^-20, e^20].
Everything is exact arithmetic on the inputs (no approximation besides float rounding).
"""

from __future__ import annotations

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "rollout_log_ratio",
    "tis_token_weights",
    "tis_sequence_weights",
    "mis_token_mask",
    "mis_sequence_mask",
    "mis_geometric_mask",
    "seq_mis",
    "kl_estimate",
    "kl_rejection_mask",
    "apply_is_weights",
]

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_shapes(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
    if old_log_probs.dim() != 2:
        raise ValueError(f"old_log_probs must be (B, T); got shape {tuple(old_log_probs.shape)}")
    for name, t in (("rollout_log_probs", rollout_log_probs), ("mask", mask)):
        if t.shape != old_log_probs.shape:
            raise ValueError(
                f"{name} must have the shape of old_log_probs {tuple(old_log_probs.shape)}; got {tuple(t.shape)}"
            )


def _check_band(low: float, high: float) -> None:
    if not 0.0 <= low <= high:
        raise ValueError(f"mask band needs 0 <= low <= high; got low={low!r}, high={high!r}")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask != 0  # (B, T) bool


def rollout_log_ratio(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Detached ``clamp(old - rollout, -20, 20)`` (B, T), zero at padding."""
    _check_shapes(old_log_probs, rollout_log_probs, mask)
    dtype = _compute_dtype(old_log_probs)
    diff = old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype)
    diff = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(_valid(mask), diff, torch.zeros_like(diff))


def _sequence_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """Sum over tokens (padding is already zero), clamped again: (B, 1)."""
    return log_ratio.sum(dim=-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _geometric_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens: (B, 1); an empty row gives 0 (ratio 1)."""
    count = _valid(mask).sum(dim=-1, keepdim=True).clamp(min=1)
    return log_ratio.sum(dim=-1, keepdim=True) / count


def _in_band(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    ratio = torch.exp(log_ratio)
    return (ratio >= low) & (ratio <= high)


def _as_keep(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Combine a (B, T) or (B, 1) keep decision with ``mask``; returned in ``mask``'s dtype."""
    return (keep & _valid(mask)).to(mask.dtype)


def _masked_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = weights.expand(mask.shape)
    return torch.where(_valid(mask), weights, torch.zeros_like(weights))


def tis_token_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, *, clip: float = 2.0
) -> torch.Tensor:
    """Truncated IS per token: ``min(exp(log_ratio_t), clip)`` (B, T), zero at padding."""
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    return _masked_weights(torch.exp(log_ratio).clamp(max=clip), mask)


def tis_sequence_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, *, clip: float = 2.0
) -> torch.Tensor:
    """Truncated IS per sequence: ``min(exp(sum_t log_ratio_t), clip)`` broadcast over the row."""
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    return _masked_weights(torch.exp(_sequence_log_ratio(log_ratio)).clamp(max=clip), mask)


def mis_token_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Masked IS per token: keep tokens whose ratio lies in ``[low, high]``."""
    _check_band(low, high)
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    return _as_keep(_in_band(log_ratio, low, high), mask)


def mis_sequence_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Masked IS per sequence: keep rows whose product ratio lies in ``[low, high]``."""
    _check_band(low, high)
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    return _as_keep(_in_band(_sequence_log_ratio(log_ratio), low, high), mask)


def mis_geometric_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.999,
    high: float = 1.001,
) -> torch.Tensor:
    """Masked IS on the per-token geometric mean ratio ``exp(mean_t log_ratio_t)`` of each row."""
    _check_band(low, high)
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    return _as_keep(_in_band(_geometric_log_ratio(log_ratio, mask), low, high), mask)


def seq_mis(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seq-MIS: sequence IS weights ``exp(sum_t log_ratio_t)`` and a keep mask rejecting rows
    outside ``[low, high]``. Returns ``(is_weights, keep_mask)``; weights of rejected rows are 0."""
    _check_band(low, high)
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    seq_log_ratio = _sequence_log_ratio(log_ratio)  # (B, 1)
    keep = _as_keep(_in_band(seq_log_ratio, low, high), mask)
    weights = _masked_weights(torch.exp(seq_log_ratio), keep)
    return weights, keep


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(rollout || train) from ``log_ratio = old - rollout`` (B, T)."""
    d = -log_ratio
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}; got {estimator!r}")


def kl_rejection_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
    threshold: float,
) -> torch.Tensor:
    """Keep rows whose mean (over valid tokens) k-estimate of KL(rollout || train) is <= threshold."""
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, mask)
    per_token = kl_estimate(log_ratio, estimator)
    per_token = torch.where(_valid(mask), per_token, torch.zeros_like(per_token))
    count = _valid(mask).sum(dim=-1, keepdim=True).clamp(min=1)
    seq_kl = per_token.sum(dim=-1, keepdim=True) / count  # (B, 1)
    return _as_keep(seq_kl <= threshold, mask)


def apply_is_weights(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct a per-token policy loss (B, T).

    Returns ``(weighted_loss, loss_mask)``: the loss multiplied by the (detached) IS weights, and
    the mask to aggregate it with (``mask`` restricted to ``keep_mask``). A token-mean loss is then
    ``(weighted_loss * loss_mask).sum() / loss_mask.sum().clamp(min=1)``.
    """
    if per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss shape {tuple(per_token_loss.shape)} must equal mask shape {tuple(mask.shape)}"
        )
    loss_mask = mask.to(per_token_loss.dtype)
    if keep_mask is not None:
        loss_mask = loss_mask * keep_mask.to(per_token_loss.dtype)
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights.detach().to(per_token_loss.dtype)
    return per_token_loss, loss_mask
