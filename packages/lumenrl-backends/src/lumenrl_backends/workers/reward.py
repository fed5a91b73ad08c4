"""Reward worker: a ``RewardFn`` over decoded responses, placed on the last response token.

``compute_reward(batch)`` reads ``raw_prompt`` and ``response_text`` (or decodes ``responses``
with the tokenizer under ``response_mask``), passes every other non-tensor column as the
per-row ``extra`` dict (e.g. ``ground_truth``), and returns ``token_level_scores`` (B, T):
the row's score at its last valid response token, 0 elsewhere. Pure CPU, so a group of several
reward workers in one process is a real (if modest) way to spread scoring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lumenrl_backends.controllers.dispatch import register
from lumenrl_core.data_proto import DataProto

__all__ = ["RewardWorker", "place_scores"]

_TEXT_KEYS = ("raw_prompt", "response_text")


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, T) with each score at the row's last mask-1 position (rows without one: 0)."""
    mask = response_mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32)
    lengths = mask.long().sum(-1)  # (B,)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    last = mask.shape[1] - 1 - mask.flip(-1).long().argmax(-1)  # (B,) index of the last 1
    out[rows, last[rows]] = scores.float()[rows]
    return out


class RewardWorker:
    """Scores rows with ``reward_fn(prompts, responses, extra) -> list[float]``."""

    def __init__(
        self, reward_fn: Callable[[list[str], list[str], list[dict]], list[float]], tokenizer: Any = None
    ):
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer

    def _responses(self, batch: DataProto) -> list[str]:
        if "response_text" in batch.non_tensor_batch:
            return [str(t) for t in batch.non_tensor_batch["response_text"]]
        if self.tokenizer is None:
            raise ValueError(
                "batch has no 'response_text' column and the RewardWorker has no tokenizer to decode"
            )
        mask = batch.batch["response_mask"].bool()
        return [
            self.tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(batch.batch["responses"], mask)
        ]

    @register(dispatch="dp_compute_proto")
    def compute_reward(self, batch: DataProto) -> DataProto:
        rows = len(batch)
        prompts = [str(p) for p in batch.non_tensor_batch.get("raw_prompt", [""] * rows)]
        extra_keys = [k for k in batch.non_tensor_batch if k not in _TEXT_KEYS]
        extra = [{k: batch.non_tensor_batch[k][i] for k in extra_keys} for i in range(rows)]
        scores = list(self.reward_fn(prompts, self._responses(batch), extra))
        if len(scores) != rows:
            raise ValueError(f"reward_fn returned {len(scores)} scores for {rows} rows; need one per row")
        scores_t = torch.tensor([float(s) for s in scores], dtype=torch.float32)
        token_level = place_scores(scores_t, batch.batch["response_mask"])
        return DataProto.from_dict(tensors={"token_level_scores": token_level, "seq_scores": scores_t})
