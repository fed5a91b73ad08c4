"""``PromptDataLoader``: records -> DataProto batches of left-padded prompts, resumable.

Every record is rendered (chat template or ``prompt_template``) and tokenized once, up front,
so over-long prompts are known before training starts: ``truncation="filter"`` drops them
(``num_filtered`` counts them), ``"left"`` keeps their last ``max_prompt_length`` tokens,
``"error"`` refuses them.

Order: epoch ``e`` visits the records in ``permutation(seed, e)`` (numpy ``default_rng([seed,
e])``), so the order depends only on (seed, epoch) and a run resumed from ``state_dict()``
(epoch, position) continues with exactly the batches an uninterrupted run would have seen.

Each batch is a ``DataProto`` with ``input_ids`` / ``attention_mask`` (B, P) int64, left-padded
to the longest prompt in the batch, non-tensors ``raw_prompt`` (prompt text), ``ground_truth``,
``extra`` (the record's extra plus ``ground_truth``: what the reward gets) and ``index`` (the
record's position in the dataset), and ``meta_info`` ``{"epoch", "position"}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lumenrl_core.data.templates import prompt_text, render_prompt
from lumenrl_core.data_proto import DataProto

__all__ = ["TRUNCATION_MODES", "PromptDataLoader"]

TRUNCATION_MODES = ("filter", "left", "error")


class PromptDataLoader:
    """Seeded, resumable batches of tokenized prompts (see the module docstring)."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        batch_size: int,
        max_prompt_length: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        truncation: str = "filter",
        prompt_template: str = "{prompt}",
        use_chat_template: bool = True,
    ) -> None:
        _check_args(batch_size, max_prompt_length, truncation)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.pad_token_id = _pad_id(tokenizer)
        self.records: list[dict[str, Any]] = []
        self.token_ids: list[list[int]] = []
        self.num_filtered = 0
        for record in records:
            text, templated = render_prompt(
                tokenizer,
                record["prompt"],
                prompt_template=prompt_template,
                use_chat_template=use_chat_template,
            )
            ids = list(tokenizer.encode(text, add_special_tokens=not templated))
            if len(ids) > max_prompt_length and not self._admit_long(len(ids)):
                continue
            self.records.append(record)
            self.token_ids.append(ids[-max_prompt_length:])
        self.row_caps = _row_caps(self.records)
        if len(self.records) < (batch_size if drop_last else 1):
            raise ValueError(
                f"dataset has {len(self.records)} usable prompts ({self.num_filtered} longer than "
                f"max_prompt_length={max_prompt_length} filtered), fewer than batch_size={batch_size}"
            )
        self.epoch = 0
        self.position = 0

    def _admit_long(self, length: int) -> bool:
        if self.truncation == "error":
            raise ValueError(
                f"a prompt has {length} tokens > max_prompt_length={self.max_prompt_length} "
                "(use truncation='filter' or 'left', or raise policy.max_prompt_length)"
            )
        self.num_filtered += self.truncation == "filter"
        return self.truncation == "left"

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.records), self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[DataProto]:
        """The remaining batches of the current epoch; the epoch then advances."""
        start_epoch = self.epoch
        while self.epoch == start_epoch:
            yield self.next_batch()

    def next_batch(self) -> DataProto:
        """The next batch, rolling over into the next (reshuffled) epoch when one ends."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        rows = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
        batch = self._collate(rows, epoch=self.epoch, position=self.position)
        self.position += 1
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mismatch = {
            k: (state.get(k), v) for k, v in (("seed", self.seed), ("num_records", len(self.records)))
        }
        bad = {k: pair for k, pair in mismatch.items() if pair[0] is not None and pair[0] != pair[1]}
        if bad:
            raise ValueError(f"dataloader state does not match this dataset ((saved, now): {bad})")
        if not 0 <= int(state["position"]) <= len(self):
            raise ValueError(f"dataloader state position={state['position']!r} is outside [0, {len(self)}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def _collate(self, rows: np.ndarray, *, epoch: int, position: int) -> DataProto:
        ids = [self.token_ids[i] for i in rows]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, seq in enumerate(ids):
            if seq:
                input_ids[r, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                attention_mask[r, width - len(seq) :] = 1
        records = [self.records[i] for i in rows]
        non_tensors = {
            "raw_prompt": [prompt_text(rec["prompt"]) for rec in records],
            "ground_truth": [rec["ground_truth"] for rec in records],
            "extra": [{**rec.get("extra", {}), "ground_truth": rec["ground_truth"]} for rec in records],
            "index": [int(i) for i in rows],
        }
        if self.row_caps:  # the dataset's own per-prompt response budget (rollout engines read it as a column)
            non_tensors["max_new_tokens"] = np.array([int(rec["extra"]["max_new_tokens"]) for rec in records])
        return DataProto.from_dict(
            {"input_ids": input_ids, "attention_mask": attention_mask},
            non_tensors,
            {"epoch": epoch, "position": position},
        )


def _row_caps(records: list[dict[str, Any]]) -> bool:
    """Whether the records carry a ``max_new_tokens`` field (every one, a positive integer, or none)."""
    have = [isinstance(rec.get("extra"), dict) and "max_new_tokens" in rec["extra"] for rec in records]
    if not any(have):
        return False
    for index, (rec, has) in enumerate(zip(records, have)):
        value = rec["extra"].get("max_new_tokens") if has else None
        if not has or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"dataset row {index}: max_new_tokens={value!r}; allowed: a positive integer in every "
                             f"row (a per-prompt response cap), or in none")
    return True


def _check_args(batch_size: int, max_prompt_length: int, truncation: str) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: allowed >= 1")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={max_prompt_length!r} is invalid: allowed >= 1")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation={truncation!r} is not supported; allowed: {', '.join(TRUNCATION_MODES)}"
        )


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0
