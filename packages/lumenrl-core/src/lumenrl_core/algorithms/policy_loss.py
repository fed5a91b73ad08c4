"""PPO clipped surrogate with clip-higher and dual-clip, per token.

For each valid token, with advantage A and ratio rho = exp(clamp(logp - logp_old, -20, 20)):

    L_clip = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
    L      = min(L_clip, -A * c)   if A < 0 and c > 1      (dual-clip, Ye et al. 2020)
             L_clip                otherwise

``eps_low`` / ``eps_high`` are epsilons (DAPO clip-higher: 0.2 / 0.28), not bounds. The
dual-clip caps the loss of negative-advantage tokens whose ratio has blown up; ``c <= 1``
disables it. Optional ``is_weights`` (rollout-correction importance weights, detached) multiply
the per-token loss before aggregation (see :mod:`lumenrl_core.algorithms.aggregation`).

Metrics (floats, or 0-dim device tensors with ``sync_metrics=False``; over valid tokens of this call):
``actor/pg_loss`` (the aggregated loss), ``actor/clip_frac`` (fraction of tokens where the
clipped term is the active max, i.e. the gradient is cut), ``actor/ppo_kl`` (mean k1 of old vs
new: logp_old - logp), ``actor/pg_clipfrac_lower`` (fraction where the dual-clip bound is active).
"""

from __future__ import annotations

import torch

from lumenrl_core import plugin_manifest as manifest
from lumenrl_core.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from lumenrl_core.algorithms.masked import masked_mean

__all__ = ["LOG_RATIO_CLAMP", "ppo_clip_token_loss", "ppo_clip_loss", "PPOClipLoss"]

LOG_RATIO_CLAMP = 20.0


def ppo_clip_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss matrix (B, T) and detached per-token diagnostics (masked means)."""
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_clip = torch.maximum(unclipped, clipped)
    stats = {
        "clip_frac": masked_mean((clipped > unclipped).float(), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (None turns dual-clip off)")
    if clip_ratio_c is None:  # dual-clip off
        stats["clipfrac_lower"] = torch.zeros((), dtype=torch.float32, device=log_probs.device)
        return loss_clip, stats
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_clip, dual_bound), loss_clip)
    stats["clipfrac_lower"] = masked_mean((negative & (loss_clip > dual_bound)).float(), mask)
    return loss, stats


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    max_len: int | None = None,
    sync_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Aggregated PPO-clip loss (scalar) and its metrics; see the module docstring.

    ``sync_metrics=False`` leaves the metrics as 0-dim float32 tensors on the loss's device, for a caller
    that reads many of them back at once (a training backend, once per optimizer step): reading them here
    would make the host wait for the forward before it can queue the backward."""
    loss_mat, stats = ppo_clip_token_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = agg_loss(
        loss_mat, mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )
    names = ("actor/pg_loss", "actor/clip_frac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
    stacked = torch.stack(
        [
            t.detach().float().to(loss.device)
            for t in (loss, *(stats[k] for k in ("clip_frac", "ppo_kl", "clipfrac_lower")))
        ]
    )
    values = stacked.tolist() if sync_metrics else list(stacked.unbind())  # tolist: one device sync for all four
    return loss, dict(zip(names, values, strict=True))


class PPOClipLoss:
    """The ``ppo_clip`` policy loss plugin (keywords match ``algorithm.*`` config fields).

    ``max_len`` is the fixed length for ``seq-mean-token-sum-norm`` (e.g. the rollout's
    ``max_new_tokens``); ``None`` uses the padded width T. A backend splitting mini-batches
    passes ``global_tokens`` / ``global_seqs`` per call to get exact mini-batch losses.
    """

    capabilities = manifest.PPO_CLIP.capabilities

    def __init__(
        self,
        *,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        loss_agg_mode: str = "token-mean",
        max_len: int | None = None,
    ) -> None:
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"loss_agg_mode={loss_agg_mode!r} is not supported; allowed: {', '.join(LOSS_AGG_MODES)}"
            )
        if not 0.0 <= clip_ratio_low < 1.0:
            raise ValueError(
                f"clip_ratio_low={clip_ratio_low!r} is invalid: an epsilon, allowed 0 <= eps_low < 1"
            )
        if clip_ratio_high < 0.0:
            raise ValueError(
                f"clip_ratio_high={clip_ratio_high!r} is invalid: an epsilon, allowed eps_high >= 0"
            )
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode
        self.max_len = max_len

    @classmethod
    def probe(cls) -> str | None:
        return manifest.PPO_CLIP.unavailable_reason()

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        is_weights: torch.Tensor | None = None,
        *,
        global_tokens: int | float | torch.Tensor | None = None,
        global_seqs: int | float | torch.Tensor | None = None,
        sync_metrics: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        return ppo_clip_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            is_weights,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            max_len=self.max_len,
            sync_metrics=sync_metrics,
        )
