"""KL estimators between the policy and a reference policy, per token.

With ``d = logp - ref_logp`` (log-probs of the *sampled* tokens, (B, T)):

- ``k1`` = d -- unbiased for KL(pi || ref), high variance, can be negative per token;
- ``k2`` = d^2 / 2 -- biased, low variance (gradient equals that of the true KL to first order);
- ``k3`` / ``low_var_kl`` = exp(-d) + d - 1 -- unbiased and non-negative (Schulman's k3),
  clamped to [-10, 10] because exp(-d) explodes when the reference is far more likely.

The log-ratio ``d`` is first clamped to [-20, 20] (as verl's ``kl_penalty`` does for
low_var_kl), for every kind, so a ``-inf`` log-prob (a token one side gives probability 0, e.g.
after top-k/top-p masking) yields a finite, bounded estimate instead of NaN; ``d`` of two
``-inf`` log-probs (both sides agree the token is impossible) counts as 0.

Used two ways: as a loss term (``kl_loss``, aggregated like the policy loss, coef ~1e-3) or
subtracted from the token rewards (``apply_kl_penalty``; then estimated with the rollout-time
``old_log_probs`` and treated as a constant).
"""

from __future__ import annotations

import torch

from lumenrl_core.algorithms.aggregation import agg_loss
from lumenrl_core.algorithms.masked import masked_mean

__all__ = ["KL_KINDS", "kl_estimate", "kl_loss", "apply_kl_penalty"]

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
_K3_CLAMP = 10.0
_LOG_RATIO_CLAMP = 20.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs) of the given ``kind``."""
    d = torch.nan_to_num(log_probs - ref_log_probs, nan=0.0).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        return (torch.exp(-d) + d - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"kl kind={kind!r} is not supported; allowed: {', '.join(KL_KINDS)}")


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    sync_metrics: bool = True,
    **agg_kwargs: object,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """KL loss term (scalar, differentiable in ``log_probs``) and ``actor/kl`` (masked token mean: a float, or a
    0-dim device tensor with ``sync_metrics=False``, see :func:`~lumenrl_core.algorithms.ppo_clip_loss`)."""
    kl = kl_estimate(log_probs, ref_log_probs, kind)
    loss = agg_loss(kl, mask, loss_agg_mode, **agg_kwargs)
    mean = masked_mean(kl.detach(), mask)
    return loss, {"actor/kl": mean.item() if sync_metrics else mean}


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``token_level_rewards = scores - coef * KL`` on valid tokens (KL treated as constant).

    Returns the rewards (B, T) and metrics ``kl_in_reward/kl`` (masked mean per-token KL) and
    ``kl_in_reward/coef``.
    """
    kl = kl_estimate(old_log_probs, ref_log_probs, kind).detach() * mask.to(token_level_scores.dtype)
    rewards = token_level_scores - coef * kl
    metrics = {"kl_in_reward/kl": masked_mean(kl, mask).item(), "kl_in_reward/coef": float(coef)}
    return rewards, metrics
