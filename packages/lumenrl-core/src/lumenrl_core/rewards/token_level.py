"""Turn per-sequence scores into the (B, T) ``token_level_scores`` of the batch contract."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["scores_to_token_level"]


def scores_to_token_level(
    scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Place each score on its row's last valid token; float32 (B, T), zeros elsewhere.

    Rows without valid tokens get no reward.
    """
    values = torch.as_tensor(scores, dtype=torch.float32, device=response_mask.device).reshape(-1)
    if values.shape[0] != response_mask.shape[0]:
        raise ValueError(f"got {values.shape[0]} scores for {response_mask.shape[0]} rows")
    valid = response_mask != 0  # (B, T)
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device).expand_as(valid)
    last = torch.where(valid, positions, -1).amax(dim=-1)  # (B,), -1 when empty
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = torch.nonzero(last >= 0).reshape(-1)
    out[rows, last[rows]] = values[rows]
    return out
