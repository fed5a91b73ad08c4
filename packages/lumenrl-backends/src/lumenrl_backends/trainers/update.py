"""The update half of an RL step: rewards -> advantages -> rollout correction -> loss functions.

Loss functions follow the training backend's contract ``loss_fn(outputs, micro) -> (loss,
metrics)``: ``outputs`` holds the micro-batch's ``log_probs`` and ``entropy`` (actor) or
``values`` (critic), each (b, T); ``micro.meta_info`` carries the mini-batch totals
``mini_batch_tokens`` / ``mini_batch_seqs``. Every loss term is aggregated against those
*global* totals, so the backend's plain sum over micro-batches (and ranks) is exactly the
mini-batch loss of ``algorithm.loss_agg_mode``.

Actor loss = PPO-clip(+ IS weights) + kl_loss_coef * KL(pi || ref) - entropy_coef * H.
Rollout correction keeps only ``rollout_keep_mask`` tokens: it is folded into
``response_mask`` before the update, so the backend's token counts see the kept tokens only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lumenrl_core.algorithms import agg_loss, apply_kl_penalty, clipped_value_loss, kl_loss, masked_mean
from lumenrl_core.data_proto import DataProto

__all__ = [
    "LossFn",
    "apply_kl_in_reward",
    "compute_advantages",
    "apply_rollout_correction",
    "actor_loss_fn",
    "critic_loss_fn",
]

LossFn = Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, Any]]]  # floats or 0-dim tensors


def apply_kl_in_reward(batch: DataProto, algo: Any) -> dict[str, float]:
    """``token_level_rewards`` = scores (- kl_reward_coef * KL(old || ref) when enabled)."""
    scores = batch.batch["token_level_scores"]
    if not algo.use_kl_in_reward:
        batch["token_level_rewards"] = scores.clone()
        return {}
    rewards, metrics = apply_kl_penalty(
        scores,
        batch.batch["old_log_probs"],
        batch.batch["ref_log_probs"],
        batch.batch["response_mask"],
        algo.kl_reward_coef,
        kind=algo.kl_loss_type,
    )
    batch["token_level_rewards"] = rewards
    return metrics


def compute_advantages(
    batch: DataProto, estimator: Callable[[DataProto], tuple[torch.Tensor, torch.Tensor]]
) -> dict:
    """Write ``advantages`` and ``returns`` (B, T); return their masked statistics."""
    advantages, returns = estimator(batch)
    batch["advantages"] = advantages.to(torch.float32)
    batch["returns"] = returns.to(torch.float32)
    mask = batch.batch["response_mask"]
    return {
        "critic/advantages_mean": masked_mean(advantages, mask).item(),
        "critic/advantages_abs_mean": masked_mean(advantages.abs(), mask).item(),
        "critic/returns_mean": masked_mean(returns, mask).item(),
    }


def apply_rollout_correction(batch: DataProto, correction: Any | None) -> dict[str, float]:
    """IS weights / keep mask from old vs rollout log-probs; the keep mask narrows ``response_mask``."""
    if correction is None:
        return {}
    mask = batch.batch["response_mask"]
    is_weights, keep, metrics = correction(
        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask
    )
    if is_weights is not None:
        batch["is_weights"] = is_weights.detach().to(torch.float32)
    keep = keep.to(mask.dtype)
    batch["rollout_keep_mask"] = keep
    batch["response_mask"] = mask * keep
    return dict(metrics)


def _global_kwargs(micro: Any) -> dict[str, float]:
    return {
        "global_tokens": micro.meta_info["mini_batch_tokens"],
        "global_seqs": micro.meta_info["mini_batch_seqs"],
    }


def _local_scale(mask: torch.Tensor, mode: str, totals: Mapping[str, float]) -> torch.Tensor:
    """Factor turning a globally-normalized micro loss into this micro-batch's own mean loss (on the mask's
    device: no read-back)."""
    per_row = mask.to(torch.float32).sum(dim=-1)
    if mode == "token-mean":
        return float(totals["global_tokens"]) / per_row.sum().clamp_min(1.0)
    return float(totals["global_seqs"]) / (per_row > 0).sum().to(torch.float32).clamp_min(1.0)


def _names_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (by name, not through ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def actor_loss_fn(policy_loss: Callable[..., Any], algo: Any) -> LossFn:
    """The actor's ``loss_fn`` for ``backend.train_step`` (PPO-clip + KL loss + entropy bonus).

    Its metrics are 0-dim device tensors (or floats, from a policy loss that returns floats): the backend reads
    them back once per ``train_step``, so nothing here makes the host wait for the forward before it queues the
    backward.
    """
    mode = algo.loss_agg_mode
    reuse = getattr(algo, "old_log_probs", "recompute") == "reuse"  # old = this forward's own, detached (ratio 1)
    lazy = {"sync_metrics": False} if _names_keyword(policy_loss, "sync_metrics") else {}

    def loss_fn(outputs: Mapping[str, torch.Tensor], micro: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        b, totals = micro.batch, _global_kwargs(micro)
        mask = b["response_mask"]
        log_probs, entropy = outputs["log_probs"], outputs["entropy"]
        old = log_probs.detach() if reuse else b["old_log_probs"]
        loss, metrics = policy_loss(log_probs, old, b["advantages"], mask, b.get("is_weights"), **totals, **lazy)
        metrics = dict(metrics)
        if reuse and "rollout_log_probs" in b:  # the engine-vs-trainer difference (a mean over micro-batches)
            delta = (log_probs.detach().float() - b["rollout_log_probs"].float()).abs()
            metrics["rollout/logprob_abs_diff_mean"] = masked_mean(delta, mask)
        metrics["actor/pg_loss"] = metrics["actor/pg_loss"] * _local_scale(mask, mode, totals)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * agg_loss(entropy, mask, mode, **totals)
        if algo.use_kl_loss:
            kl, kl_metrics = kl_loss(
                log_probs, b["ref_log_probs"], mask, kind=algo.kl_loss_type, loss_agg_mode=mode,
                sync_metrics=False, **totals,
            )
            loss = loss + algo.kl_loss_coef * kl
            metrics.update(kl_metrics)
        elif "ref_log_probs" in b:
            metrics["actor/kl"] = masked_mean(log_probs.detach() - b["ref_log_probs"], mask)
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic: Any, loss_agg_mode: str) -> LossFn:
    """The critic's ``loss_fn``: clipped value loss against ``returns``."""

    def loss_fn(outputs: Mapping[str, torch.Tensor], micro: Any) -> tuple[torch.Tensor, dict[str, float]]:
        b, totals = micro.batch, _global_kwargs(micro)
        loss, metrics = clipped_value_loss(
            outputs["values"],
            b["values"],
            b["returns"],
            b["response_mask"],
            cliprange_value=critic.cliprange_value,
            loss_agg_mode=loss_agg_mode,
            sync_metrics=False,
            **totals,
        )
        metrics["critic/vf_loss"] = metrics["critic/vf_loss"] * _local_scale(b["response_mask"], loss_agg_mode, totals)
        return critic.value_loss_coef * loss, metrics

    return loss_fn
