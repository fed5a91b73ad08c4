"""DAPO reward shaping and dynamic sampling (Yu et al. 2025).

Overlong shaping: with maximum response length L_max and buffer L_buf, a response of length
``len`` earns

    penalty = min(-(len - (L_max - L_buf)) / L_buf * factor, 0)   if len > L_max - L_buf, else 0

(a linear ramp from 0 at L_max - L_buf to -factor at L_max), added to its outcome score on the
last valid token.

Dynamic sampling: a group (responses sharing a ``uid``) whose scores are all equal has zero
GRPO advantage and contributes no gradient; the trainer drops such groups and generates more
batches (at most ``max_num_gen_batches``) until the train batch is full.
``dynamic_sampling_keep_indices`` returns the rows to keep; ``DynamicSamplingState`` counts
generation rounds and kept groups for the trainer's fill loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lumenrl_core.algorithms.advantages import group_index

__all__ = [
    "overlong_penalty",
    "apply_overlong_penalty",
    "dynamic_sampling_keep_indices",
    "DynamicSamplingState",
]


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Per-sequence penalty (B,), <= 0, float32; see the module docstring."""
    if overlong_buffer_len <= 0 or overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len!r} is invalid: allowed 0 < L_buf <= "
            f"max_response_length ({max_response_length})"
        )
    expected = max_response_length - overlong_buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Add the overlong penalty on each row's last valid token; returns scores and metrics."""
    lengths = response_mask.to(torch.long).sum(dim=-1)  # (B,)
    penalty = overlong_penalty(
        lengths,
        max_response_length=max_response_length,
        overlong_buffer_len=overlong_buffer_len,
        penalty_factor=penalty_factor,
    ).to(token_level_scores.dtype)
    last = (lengths - 1).clamp_min(0).unsqueeze(-1)  # (B, 1)
    has_tokens = (lengths > 0).to(token_level_scores.dtype)
    shaped = token_level_scores.scatter_add(-1, last, (penalty * has_tokens).unsqueeze(-1))
    metrics = {
        "dapo/overlong_penalty_mean": penalty.mean().item() if penalty.numel() else 0.0,
        "dapo/overlong_frac": (penalty < 0).float().mean().item() if penalty.numel() else 0.0,
    }
    return shaped, metrics


def dynamic_sampling_keep_indices(scores: torch.Tensor | Sequence[float], uid: Sequence[Any]) -> np.ndarray:
    """Row indices (ascending, int64) of groups whose scores are not all equal."""
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    if len(uid) != s.shape[0]:
        raise ValueError(f"uid has {len(uid)} entries but scores has {s.shape[0]}")
    index, n_groups = group_index(uid)
    g_max = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, s, "amax")
    g_min = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, s, "amin")
    keep_group = g_max > g_min
    return torch.nonzero(keep_group[index]).reshape(-1).numpy().astype(np.int64)


@dataclass(kw_only=True, slots=True)
class DynamicSamplingState:
    """Book-keeping of one train step's fill loop.

    ``target_groups``: groups (prompts) the train batch needs; ``max_num_gen_batches``: bound on
    generation rounds (<= 0: unbounded). Call ``record(kept_groups)`` after each round;
    ``done`` tells whether to stop; ``exhausted`` whether the bound was hit before filling.
    """

    target_groups: int
    max_num_gen_batches: int
    rounds: int = 0
    kept_groups: int = 0

    def record(self, kept_groups: int) -> None:
        self.rounds += 1
        self.kept_groups += kept_groups

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.target_groups

    @property
    def exhausted(self) -> bool:
        return 0 < self.max_num_gen_batches <= self.rounds and not self.full

    @property
    def done(self) -> bool:
        return self.full or self.exhausted

    def metrics(self) -> dict[str, float]:
        return {"dapo/gen_batches": float(self.rounds), "dapo/kept_groups": float(self.kept_groups)}
