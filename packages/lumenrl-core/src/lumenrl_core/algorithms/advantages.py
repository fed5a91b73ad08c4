"""Advantage estimators: outcome-based (GRPO, Dr.GRPO, RLOO) and GAE.

Outcome estimators score a whole response: r_i = sum_t token_level_rewards[i, t] * mask[i, t]
(the reward sits on the last response token). Responses sharing a ``uid`` form a group (the n
samples of one prompt). Within a group g of size n:

- GRPO:     A_i = (r_i - mean_g) / (std_g + eps), std unbiased (n - 1), eps = 1e-6;
- Dr.GRPO:  A_i = r_i - mean_g (no std division, Liu et al. 2025);
- RLOO:     A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g).

Groups of size 1 get A = 0 (no baseline, no signal). The sequence advantage is broadcast to
every valid token; returns equal the advantages. All statistics are computed in float64 and
cast back, so ties (all rewards equal) give exactly 0.

GAE over a critic's values V (B, T) and token rewards r (B, T), walking valid tokens only
(padding and masked-out tokens are skipped, the value after the last valid token is 0):

    delta_t = r_t + gamma * V_next - V_t;   A_t = delta_t + gamma * lam * A_next
    returns = A + V;   advantages = whiten(A) over all valid tokens (mean 0, unbiased std 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from lumenrl_core import plugin_manifest as manifest
from lumenrl_core.algorithms.masked import masked_whiten
from lumenrl_core.plugins.spec import PluginSpec

__all__ = [
    "group_index",
    "outcome_scores",
    "grpo_outcome_advantage",
    "drgrpo_outcome_advantage",
    "rloo_outcome_advantage",
    "gae_advantage",
    "GRPOAdvantage",
    "DrGRPOAdvantage",
    "RLOOAdvantage",
    "GAEAdvantage",
]

GRPO_EPS = 1e-6


def group_index(uid: Sequence[Any]) -> tuple[torch.Tensor, int]:
    """Map group ids (any hashables) to dense indices in first-seen order: (B,) int64, #groups."""
    ids: dict[Any, int] = {}
    index = [ids.setdefault(u, len(ids)) for u in uid]
    return torch.tensor(index, dtype=torch.long), len(ids)


def outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence score r_i = masked sum of token rewards, (B,)."""
    return (token_level_rewards * response_mask.to(token_level_rewards.dtype)).sum(dim=-1)


def _group_stats(scores: torch.Tensor, uid: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 per-row group (count, mean, unbiased std); std is 0 for groups of size 1."""
    if len(uid) != scores.shape[0]:
        raise ValueError(f"uid has {len(uid)} entries but the batch has {scores.shape[0]} rows")
    index, n_groups = group_index(uid)
    index = index.to(scores.device)
    s = scores.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(
        0, index, torch.ones_like(s)
    )
    mean = torch.zeros_like(count).index_add_(0, index, s) / count
    sq_dev = torch.zeros_like(count).index_add_(0, index, (s - mean[index]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1.0).clamp_min(1.0))
    return count[index], mean[index], std[index]


def _broadcast(
    seq_adv: torch.Tensor, like: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    adv = seq_adv.to(like.dtype).unsqueeze(-1) * mask.to(like.dtype)  # (B, T)
    return adv, adv.clone()


def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any],
    *,
    norm_adv_by_std: bool = True,
    eps: float = GRPO_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (or Dr.GRPO with ``norm_adv_by_std=False``) advantages and returns, both (B, T)."""
    scores = outcome_scores(token_level_rewards, response_mask)
    count, mean, std = _group_stats(scores, uid)
    centered = scores.to(torch.float64) - mean
    seq_adv = centered / (std + eps) if norm_adv_by_std else centered
    seq_adv = torch.where(count > 1, seq_adv, torch.zeros_like(seq_adv))
    return _broadcast(seq_adv, token_level_rewards, response_mask)


def drgrpo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: group-mean baseline, no std normalization."""
    return grpo_outcome_advantage(token_level_rewards, response_mask, uid, norm_adv_by_std=False)


def rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: leave-one-out mean baseline."""
    scores = outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, uid)
    seq_adv = count / (count - 1.0).clamp_min(1.0) * (scores.to(torch.float64) - mean)
    seq_adv = torch.where(count > 1, seq_adv, torch.zeros_like(seq_adv))
    return _broadcast(seq_adv, token_level_rewards, response_mask)


def gae_advantage(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages (whitened over valid tokens) and returns = A + V, both (B, T), 0 off-mask."""
    mask = response_mask.to(torch.float64)
    rewards, vals = token_level_rewards.to(torch.float64), values.detach().to(torch.float64)
    next_value = torch.zeros_like(vals[:, 0])  # (B,)
    next_adv = torch.zeros_like(vals[:, 0])
    raw = torch.zeros_like(vals)
    for t in reversed(range(vals.shape[1])):
        m = mask[:, t]
        adv_t = rewards[:, t] + gamma * next_value - vals[:, t] + gamma * lam * next_adv
        raw[:, t] = adv_t * m
        next_value = m * vals[:, t] + (1.0 - m) * next_value
        next_adv = m * adv_t + (1.0 - m) * next_adv
    returns = (raw + vals) * mask
    advantages = masked_whiten(raw, mask) * mask if whiten else raw
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


class _OutcomeEstimator:
    """Shared plumbing of the outcome plugins: read the batch, call the pure function."""

    plugin_spec: ClassVar[PluginSpec]  # each plugin's spec in lumenrl_core.plugin_manifest

    @classmethod
    def probe(cls) -> str | None:
        return cls.plugin_spec.unavailable_reason()

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rewards = batch.batch["token_level_rewards"]
        mask = batch.batch["response_mask"]
        return self._estimate(rewards, mask, list(batch.non_tensor_batch["uid"]))

    def _estimate(
        self, rewards: torch.Tensor, mask: torch.Tensor, uid: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class GRPOAdvantage(_OutcomeEstimator):
    """``grpo`` estimator; ``norm_adv_by_std=False`` is Dr.GRPO."""

    plugin_spec = manifest.GRPO
    capabilities = manifest.GRPO.capabilities

    def __init__(self, *, norm_adv_by_std: bool = True, eps: float = GRPO_EPS) -> None:
        self.norm_adv_by_std = norm_adv_by_std
        self.eps = eps

    def _estimate(
        self, rewards: torch.Tensor, mask: torch.Tensor, uid: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return grpo_outcome_advantage(rewards, mask, uid, norm_adv_by_std=self.norm_adv_by_std, eps=self.eps)


class DrGRPOAdvantage(_OutcomeEstimator):
    """``drgrpo`` estimator: group-mean baseline without std normalization."""

    plugin_spec = manifest.DRGRPO
    capabilities = manifest.DRGRPO.capabilities

    def _estimate(
        self, rewards: torch.Tensor, mask: torch.Tensor, uid: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return drgrpo_outcome_advantage(rewards, mask, uid)


class RLOOAdvantage(_OutcomeEstimator):
    """``rloo`` estimator: leave-one-out baseline."""

    plugin_spec = manifest.RLOO
    capabilities = manifest.RLOO.capabilities

    def _estimate(
        self, rewards: torch.Tensor, mask: torch.Tensor, uid: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rloo_outcome_advantage(rewards, mask, uid)


class GAEAdvantage:
    """``gae`` estimator over the critic's ``values`` (its spec requires ``critic``: ``critic.enabled``)."""

    capabilities = manifest.GAE.capabilities
    requires = manifest.GAE.requires

    def __init__(self, *, gamma: float = 1.0, lam: float = 1.0) -> None:
        for name, value in (("gamma", gamma), ("lam", lam)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value!r} is invalid: allowed 0 <= {name} <= 1")
        self.gamma = gamma
        self.lam = lam

    @classmethod
    def probe(cls) -> str | None:
        return manifest.GAE.unavailable_reason()

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "values" not in batch.batch:
            raise KeyError(
                "GAE needs batch key 'values' (B, T) from the critic; enable critic for adv_estimator=gae"
            )
        return gae_advantage(
            batch.batch["token_level_rewards"],
            batch.batch["values"],
            batch.batch["response_mask"],
            gamma=self.gamma,
            lam=self.lam,
        )
