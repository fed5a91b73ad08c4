"""Scoring: decoded responses -> the reward function -> ``token_level_scores`` (+ DAPO shaping).

The reward function (a ``lumenrl.rewards`` plugin or the user's ``reward.function``) sees
strings: ``(prompts, responses, extra) -> list[float]`` with one ``extra`` dict per row holding
the row's dataset fields (``ground_truth`` and any others). Response strings are the engine's
``response_text`` column when it wrote one (every LumenRL engine does, decoded with the same
tokenizer and special tokens dropped), so a step decodes once; otherwise they are decoded here.
The score is placed on the last valid response token (the contract's ``token_level_scores``);
DAPO overlong shaping then adds its length penalty there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lumenrl_backends.engines.requests import decode_texts
from lumenrl_backends.workers.reward import place_scores
from lumenrl_core.algorithms import apply_overlong_penalty
from lumenrl_core.data_proto import DataProto

__all__ = ["Scorer", "decode_responses", "scores_on_last_token", "extra_fields"]

# Per-row fields that are bookkeeping, not reward inputs.
_NOT_EXTRA = ("uid", "raw_prompt", "response_text", "finish_reason", "seed", "index")


def decode_responses(tokenizer: Any, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Response text per row, masked-out tokens and special tokens (EOS) dropped."""
    rows = [r[m.bool()].tolist() for r, m in zip(responses, response_mask)]
    return decode_texts(tokenizer, rows)


def scores_on_last_token(scores: Sequence[float], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) float32 zeros with each row's score on its last valid response token."""
    return place_scores(torch.as_tensor(list(scores), dtype=torch.float32), response_mask)


def extra_fields(batch: DataProto) -> list[dict[str, Any]]:
    """One dict per row for the reward: the dataloader's ``extra`` column (the record's fields
    plus ``ground_truth``) when present, else the batch's per-row dataset fields."""
    if "extra" in batch.non_tensor_batch:
        return [dict(e) for e in batch.non_tensor_batch["extra"]]
    keys = [k for k in batch.non_tensor_batch if k not in _NOT_EXTRA]
    return [{k: batch.non_tensor_batch[k][i] for k in keys} for i in range(len(batch))]


@dataclass(kw_only=True, slots=True)
class Scorer:
    """Scores a generated batch in place (``response_text``, ``token_level_scores``); returns metrics."""

    reward_fn: Callable[[list[str], list[str], list[dict]], Sequence[float]]
    tokenizer: Any
    max_response_length: int
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0

    def response_texts(self, batch: DataProto) -> list[str]:
        """The engine's ``response_text`` when present, else decoded from ``responses``."""
        if "response_text" in batch.non_tensor_batch:
            return [str(t) for t in batch.non_tensor_batch["response_text"]]
        return decode_responses(self.tokenizer, batch.batch["responses"], batch.batch["response_mask"])

    def raw_rewards(self, batch: DataProto) -> tuple[list[str], list[float]]:
        """(response texts, the reward function's score per row), before any shaping."""
        texts = self.response_texts(batch)
        prompts = [str(p) for p in batch.non_tensor_batch.get("raw_prompt", [""] * len(batch))]
        raw = [float(s) for s in self.reward_fn(prompts, texts, extra_fields(batch))]
        if len(raw) != len(batch):
            raise ValueError(f"reward function returned {len(raw)} scores for a batch of {len(batch)} rows")
        return texts, raw

    def __call__(self, batch: DataProto) -> dict[str, float]:
        mask = batch.batch["response_mask"]
        texts, raw = self.raw_rewards(batch)
        scores = scores_on_last_token(raw, mask)
        metrics: dict[str, float] = {}
        if self.overlong_buffer_len > 0:
            scores, metrics = apply_overlong_penalty(
                scores,
                mask,
                max_response_length=self.max_response_length,
                overlong_buffer_len=self.overlong_buffer_len,
                penalty_factor=self.overlong_penalty_factor,
            )
        batch["response_text"] = np.array(texts, dtype=object)
        batch["token_level_scores"] = scores
        return {**metrics, **reward_metrics(torch.as_tensor(raw, dtype=torch.float32))}


def reward_metrics(raw: torch.Tensor) -> dict[str, float]:
    """Mean/std/max/min of the raw (unshaped) rewards of a batch."""
    if raw.numel() == 0:
        return {}
    std = raw.std(unbiased=False).item() if raw.numel() > 1 else 0.0
    return {
        "reward/mean": raw.mean().item(),
        "reward/std": std,
        "reward/max": raw.max().item(),
        "reward/min": raw.min().item(),
    }
