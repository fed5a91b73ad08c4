"""Draft vocabulary from token frequencies: the ``d2t`` / ``t2d`` maps of Eagle3.

The draft predicts over the ``draft_vocab_size`` most frequent target tokens of the training
data (ties: lower id first). ``d2t[i] = target_id(i) - i`` (an offset, the convention vLLM and
SGLang read: ``target = draft + d2t[draft]``); ``t2d`` is a bool mask over the target vocab.
"""

from __future__ import annotations

import torch

__all__ = ["token_counts", "draft_vocab_maps", "draft_to_target"]


def token_counts(input_ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T) ids + (B, T) 0/1 mask -> (vocab_size,) int64 counts."""
    return torch.bincount(input_ids[mask.bool()].flatten(), minlength=vocab_size)[:vocab_size]


def draft_vocab_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts (V,) -> (d2t (Vd,) int64 offsets, t2d (V,) bool)."""
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab}] (the target vocabulary)")
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))[:draft_vocab_size]
    chosen = torch.tensor(sorted(order), dtype=torch.int64)  # target ids, increasing
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]
