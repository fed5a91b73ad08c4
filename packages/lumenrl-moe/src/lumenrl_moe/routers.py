"""MoE router math for R3: select top-k experts (recording) and recompute gate weights over a
*forced* expert set (replay), per router family. Registered under ``lumenrl.moe_routers`` by
HF ``model_type``.

Replay keeps the training router differentiable: the expert set comes from the rollout
(``indices`` (N, k)), the gate weights are recomputed from the training router's own logits
(N, E), so gradients reach the router. All math in float32 (logits are upcast), as the HF
implementations do; weights are returned in float32.

- Softmax top-k (Qwen2/3-MoE, Mixtral): p = softmax(logits); w = p[indices]; if
  ``norm_topk_prob`` then w /= sum(w). Mixtral always renormalizes.
- Sigmoid group-limited top-k (DeepSeek-V3, GLM-4-MoE): s = sigmoid(logits); selection uses
  s + e_score_correction_bias, restricted to the ``topk_group`` best of ``n_group`` groups
  (group score = sum of its top-2 biased scores); w = s[indices] (no bias), renormalized if
  ``norm_topk_prob``, times ``routed_scaling_factor``. Masked-out groups are excluded with
  -inf (HF fills 0.0, which differs only when a biased score is negative).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lumenrl_moe import plugin_manifest as manifest

__all__ = ["SoftmaxTopKRouter", "SigmoidGroupTopKRouter"]


def _cfg(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _check_indices(logits: torch.Tensor, indices: torch.Tensor, top_k: int) -> None:
    if indices.shape != (*logits.shape[:-1], top_k):
        raise ValueError(f"indices.shape={tuple(indices.shape)}: expected {(*logits.shape[:-1], top_k)} "
                         f"for logits.shape={tuple(logits.shape)} and top_k={top_k}")


class SoftmaxTopKRouter:
    """Softmax over all experts, top-k, optional renormalization (Qwen2/3-MoE, Mixtral)."""

    capabilities = manifest.SOFTMAX_TOPK.capabilities

    def __init__(self, *, top_k: int, norm_topk_prob: bool = True) -> None:
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: expected >= 1")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    @classmethod
    def probe(cls) -> str | None:
        return manifest.SOFTMAX_TOPK.unavailable_reason()

    @classmethod
    def from_model_config(cls, config: Any) -> SoftmaxTopKRouter:
        """From an HF config (object or dict): ``num_experts_per_tok``, ``norm_topk_prob``."""
        model_type = _cfg(config, "model_type", "")
        norm = True if model_type == "mixtral" else bool(_cfg(config, "norm_topk_prob", True))
        return cls(top_k=int(_cfg(config, "num_experts_per_tok", 2)), norm_topk_prob=norm)

    def _weights(self, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        weights = probs.gather(-1, indices)  # (N, k)
        return weights / weights.sum(-1, keepdim=True) if self.norm_topk_prob else weights

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights (N, k) float32, indices (N, k) int64)`` chosen by this router."""
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        indices = probs.topk(self.top_k, dim=-1).indices
        return self._weights(probs, indices), indices

    def replay(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Gate weights (N, k) of the recorded ``indices`` under these ``logits`` (differentiable)."""
        _check_indices(logits, indices, self.top_k)
        return self._weights(torch.softmax(logits.float(), dim=-1), indices.long())


class SigmoidGroupTopKRouter:
    """Sigmoid scores, bias-corrected group-limited top-k, scaled (DeepSeek-V3, GLM-4-MoE)."""

    capabilities = manifest.SIGMOID_GROUP_TOPK.capabilities

    def __init__(
        self,
        *,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        norm_topk_prob: bool = True,
        e_score_correction_bias: torch.Tensor | None = None,
    ) -> None:
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group}: expected 1 <= topk_group <= n_group={n_group}")
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: expected >= 1")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.e_score_correction_bias = e_score_correction_bias

    @classmethod
    def probe(cls) -> str | None:
        return manifest.SIGMOID_GROUP_TOPK.unavailable_reason()

    @classmethod
    def from_model_config(cls, config: Any, e_score_correction_bias: torch.Tensor | None = None) -> SigmoidGroupTopKRouter:
        """From an HF config: ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
        ``norm_topk_prob``; the bias is a model parameter, passed separately."""
        return cls(top_k=int(_cfg(config, "num_experts_per_tok", 8)), n_group=int(_cfg(config, "n_group", 1)),
                   topk_group=int(_cfg(config, "topk_group", 1)),
                   routed_scaling_factor=float(_cfg(config, "routed_scaling_factor", 1.0)),
                   norm_topk_prob=bool(_cfg(config, "norm_topk_prob", True)),
                   e_score_correction_bias=e_score_correction_bias)

    def _weights(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(-1, indices)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor

    def _choice(self, scores: torch.Tensor) -> torch.Tensor:
        """Biased scores with experts outside the best ``topk_group`` groups set to -inf. (N, E)"""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        n, e = choice.shape[:-1], choice.shape[-1]
        if e % self.n_group:
            raise ValueError(f"num_experts={e} is not divisible by n_group={self.n_group}")
        grouped = choice.reshape(*n, self.n_group, e // self.n_group)  # (N, G, E/G)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (N, G)
        keep_groups = group_scores.topk(self.topk_group, dim=-1).indices  # (N, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, keep_groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(*n, e)
        return choice.masked_fill(~expert_mask, float("-inf"))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights (N, k) float32, indices (N, k) int64)`` chosen by this router."""
        scores = torch.sigmoid(logits.float())  # (N, E)
        indices = self._choice(scores.detach()).topk(self.top_k, dim=-1).indices
        return self._weights(scores, indices), indices

    def replay(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Gate weights (N, k) of the recorded ``indices`` under these ``logits`` (differentiable)."""
        _check_indices(logits, indices, self.top_k)
        return self._weights(torch.sigmoid(logits.float()), indices.long())
