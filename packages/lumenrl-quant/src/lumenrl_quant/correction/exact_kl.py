"""Exact train/rollout KL from full-vocabulary log-probs, before and after TIS.

Design
------
The sampled-token estimators (:func:`~lumenrl_quant.correction.functional.kl_estimate`) see one
token per position. When both models' full next-token distributions are at hand (a small model,
a diagnostic pass), the KL can be computed exactly per position instead:

    before:  KL(p_train || p_rollout)      = sum_v p_train(v) (log p_train(v) - log p_rollout(v))

Token-level TIS with cap C weights a token sampled from ``p_rollout`` by ``min(p_train / p_rollout, C)``,
so the corrected objective samples, in effect, from

    q_TIS(v) = min(p_train(v), C * p_rollout(v)) / Z          (Z normalizes)

and ``after`` is ``KL(p_train || q_TIS)``. Where no token's ratio exceeds C, ``q_TIS = p_train`` and
the KL after TIS is zero; the cap is what is left of the mismatch. Both are means over the valid
positions of ``mask``, computed in float64 from the given log-probs (renormalized there, so a float32
``log_softmax`` rounding cannot make a KL negative; exact up to float64 rounding).
"""

from __future__ import annotations

import math

import torch

__all__ = ["train_rollout_kl"]


def train_rollout_kl(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_clip: float | None = None,
) -> torch.Tensor:
    """Mean over valid positions of KL(p_train || p_rollout) (``tis_clip=None``) or KL(p_train || q_TIS).

    ``train_log_probs``, ``rollout_log_probs``: (B, T, V) normalized log-probabilities (``log_softmax`` of
    each model's logits at the response positions); ``mask`` (B, T), non-zero at valid tokens. Returns a
    0-dim float64 tensor (0 when no position is valid).
    """
    if train_log_probs.dim() != 3 or rollout_log_probs.shape != train_log_probs.shape:
        raise ValueError(f"train_log_probs and rollout_log_probs must both be (B, T, V); got "
                         f"{tuple(train_log_probs.shape)} and {tuple(rollout_log_probs.shape)}")
    if mask.shape != train_log_probs.shape[:2]:
        raise ValueError(f"mask must be (B, T) = {tuple(train_log_probs.shape[:2])}; got {tuple(mask.shape)}")
    if tis_clip is not None and not tis_clip > 0:
        raise ValueError(f"tis_clip must be > 0 (or None for the uncorrected KL); got {tis_clip!r}")
    lp_train = train_log_probs.detach().double().log_softmax(-1)  # renormalized in float64: KL >= 0 to rounding
    log_q = rollout_log_probs.detach().double().log_softmax(-1)
    if tis_clip is not None:  # q_TIS = min(p_train, C p_rollout) / Z
        log_q = torch.minimum(lp_train, log_q + math.log(tis_clip))
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
    per_position = (lp_train.exp() * (lp_train - log_q)).sum(-1).clamp(min=0)  # (B, T); KL >= 0, less is rounding
    valid = mask != 0
    return (per_position * valid).sum() / valid.sum().clamp(min=1)
