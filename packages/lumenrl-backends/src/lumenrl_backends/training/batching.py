"""Row slicing of ``DataProto`` batches for data parallelism and gradient accumulation.

Row slices are ``DataProto`` slices (tensor views, ``meta_info`` shallow-copied).

Splitting (rows of the global batch, W = data-parallel ranks):

- mini-batches: consecutive chunks of ``mini_batch_size`` rows (one optimizer step each);
- DP: rank r takes rows ``[r * n / W, (r + 1) * n / W)`` of a mini-batch (n divisible by W);
- micro-batches: consecutive chunks of ``micro_batch_size`` rows of the rank's slice (the last
  may be smaller; losses are normalized by global counts, so sizes need not match).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split_rows", "dp_slice_bounds", "pad_rows", "position_ids_from_mask"]


def split_rows(batch: Any, size: int) -> list[Any]:
    """Consecutive chunks of ``size`` rows (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"split size={size} must be >= 1")
    return [batch[s : s + size] for s in range(0, len(batch), size)]


def dp_slice_bounds(total: int, rank: int, world: int) -> tuple[int, int]:
    if total % world:
        raise ValueError(f"{total} rows cannot be split evenly over {world} data-parallel ranks")
    per = total // world
    return rank * per, (rank + 1) * per


def pad_rows(tensors: dict[str, torch.Tensor], divisor: int) -> tuple[dict[str, torch.Tensor], int]:
    """Append copies of the first rows so the row count divides ``divisor``; returns (padded, pad)."""
    total = int(next(iter(tensors.values())).shape[0])
    pad = (-total) % divisor
    if pad == 0:
        return tensors, 0
    idx = torch.arange(pad) % total
    return {k: torch.cat([v, v[idx.to(v.device)]], dim=0) for k, v in tensors.items()}, pad


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens (left padding gets position 0): (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
