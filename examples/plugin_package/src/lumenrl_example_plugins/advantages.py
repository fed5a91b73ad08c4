"""Two advantage estimators: ``rank`` (critic-free, per prompt group) and ``mc_value`` (critic baseline).

``rank``: outcome scores r_i = sum_t token_level_rewards[i, t] * mask[i, t] (the reward sits on the
last response token); responses sharing a ``uid`` form a group g of size n (the n samples of one
prompt). Each response's advantage is its centered rank in the group, scaled to [-1, 1]:

    A_i = (#{j in g : r_j < r_i} - #{j in g : r_j > r_i}) / (n - 1)

which equals (2 * rank_i - (n + 1)) / (n - 1) with rank_i the 1-based rank, ties sharing their
average rank. So A_i lies in [-1, 1], sums to 0 over a group, is 0 for a group whose rewards are all
equal and for a group of one, and is unchanged by any strictly increasing transform of the rewards
(a reward on [0, 100] or a shaped one trains like the raw one): only the order within a group
counts, which bounds the update no matter how the reward is scaled. Comparisons are exact in
float64. The sequence advantage is broadcast to every valid token; returns equal the advantages.

``mc_value``: REINFORCE with a learned value baseline over the critic's values V (B, T). On valid
tokens only (padding skipped), the discounted reward-to-go and its advantage are

    G_t = r_t + gamma * G_next (G after the last valid token = 0);   A_t = G_t - V_t;   returns = G

with no whitening (GAE with lam = 1 before whitening is the same quantity). It needs the critic's
``values`` in the batch, which its spec declares (``requires={"critic"}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lumenrl_core.algorithms.advantages import group_index, outcome_scores
from lumenrl_example_plugins import plugin_manifest as manifest

__all__ = ["rank_outcome_advantage", "mc_value_advantage", "RankAdvantage", "MonteCarloValueAdvantage"]


def rank_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered group-rank advantages and returns, both (B, T), 0 off the mask."""
    if len(uid) != token_level_rewards.shape[0]:
        raise ValueError(f"uid has {len(uid)} entries but the batch has {token_level_rewards.shape[0]} rows")
    scores = outcome_scores(token_level_rewards, response_mask).to(torch.float64)  # (B,)
    index, _ = group_index(uid)
    index = index.to(scores.device)
    same = index[:, None] == index[None, :]  # (B, B): rows i and j answer the same prompt
    worse = (same & (scores[None, :] < scores[:, None])).sum(dim=1)  # (B,) members scored below row i
    better = (same & (scores[None, :] > scores[:, None])).sum(dim=1)
    n = same.sum(dim=1).to(torch.float64)
    seq_adv = (worse - better).to(torch.float64) / (n - 1.0).clamp_min(1.0)  # n = 1: worse = better = 0
    adv = seq_adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask.to(token_level_rewards.dtype)
    return adv, adv.clone()


def mc_value_advantage(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A = G - V, returns = G), both (B, T), 0 off the mask; G is the discounted reward-to-go."""
    mask = response_mask.to(torch.float64)
    rewards, vals = token_level_rewards.to(torch.float64), values.detach().to(torch.float64)
    to_go = torch.zeros_like(rewards)  # (B, T)
    running = torch.zeros_like(rewards[:, 0])  # (B,): G of the next valid token
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1.0 - m) * running
        to_go[:, t] = running * m
    dtype = token_level_rewards.dtype
    return ((to_go - vals) * mask).to(dtype), to_go.to(dtype)


class RankAdvantage:
    """``rank`` estimator (``lumenrl.advantage_estimators``): centered group ranks of the outcome scores."""

    capabilities = manifest.RANK.capabilities
    requires = manifest.RANK.requires

    @classmethod
    def probe(cls) -> str | None:
        return manifest.RANK.unavailable_reason()

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return rank_outcome_advantage(
            batch.batch["token_level_rewards"], batch.batch["response_mask"], list(batch.non_tensor_batch["uid"])
        )


class MonteCarloValueAdvantage:
    """``mc_value`` estimator: reward-to-go minus the critic's values (needs ``critic.enabled``)."""

    capabilities = manifest.MC_VALUE.capabilities
    requires = manifest.MC_VALUE.requires

    def __init__(self, *, gamma: float = 1.0) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma={gamma!r} is invalid (algorithm.gamma): allowed 0 <= gamma <= 1")
        self.gamma = gamma

    @classmethod
    def probe(cls) -> str | None:
        return manifest.MC_VALUE.unavailable_reason()

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "values" not in batch.batch:
            raise KeyError("mc_value needs batch key 'values' (B, T) from the critic; set critic.enabled=true")
        return mc_value_advantage(
            batch.batch["token_level_rewards"], batch.batch["values"], batch.batch["response_mask"],
            gamma=self.gamma,
        )
