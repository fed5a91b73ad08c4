"""``build_dataset`` / ``build_dataloader``: records and batches from a ``DatasetConfig``.

Dataset names: ``arithmetic`` (+ and -), ``arithmetic_mul`` (+, - and *), ``countdown``
(generated in code, ``difficulty`` = digits per operand / numbers per problem), ``jsonl`` and
``parquet`` (a local file at ``dataset.path``, read with ``prompt_key`` / ``answer_key``).
For generated tasks the ``test`` split is drawn with another seed and excludes every train
prompt (as far as the problem space allows); for files both splits are the file.
"""

from __future__ import annotations

import difflib
from typing import Any

from lumenrl_core.config.schema import DatasetConfig
from lumenrl_core.data.loader import PromptDataLoader
from lumenrl_core.data.records import load_records
from lumenrl_core.data.tasks import ArithmeticTask, CountdownTask

__all__ = ["DATASET_NAMES", "SPLITS", "build_dataset", "build_dataloader"]

DATASET_NAMES = ("arithmetic", "arithmetic_mul", "countdown", "jsonl", "parquet")
SPLITS = ("train", "test")
_TEST_SEED_OFFSET = 1_000_003


def _task(cfg: DatasetConfig, seed: int, num_examples: int) -> ArithmeticTask | CountdownTask:
    if cfg.name == "countdown":
        return CountdownTask(num_examples=num_examples, num_numbers=max(2, cfg.difficulty + 1), seed=seed)
    ops = ("+", "-", "*") if cfg.name == "arithmetic_mul" else ("+", "-")
    return ArithmeticTask(num_examples=num_examples, difficulty=cfg.difficulty, ops=ops, seed=seed)


def build_dataset(
    cfg: DatasetConfig, *, seed: int = 0, split: str = "train", num_examples: int | None = None
) -> list[dict[str, Any]]:
    """Records (``prompt``, ``ground_truth``, ``extra``) of the configured dataset and split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not supported; allowed: {', '.join(SPLITS)}")
    if cfg.name in ("jsonl", "parquet"):
        if not cfg.path:
            raise ValueError(f"dataset.name={cfg.name!r} needs dataset.path (a local .{cfg.name} file)")
        return load_records(cfg.path, fmt=cfg.name, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    if cfg.name not in DATASET_NAMES:
        close = difflib.get_close_matches(cfg.name, DATASET_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"dataset.name={cfg.name!r} is not supported{hint}; allowed: {', '.join(DATASET_NAMES)}"
        )
    train = _task(cfg, seed, cfg.num_examples).records()
    if split == "train":
        return train
    exclude = frozenset(r["prompt"] for r in train)
    return _task(cfg, seed + _TEST_SEED_OFFSET, num_examples or cfg.num_examples).records(exclude=exclude)


def build_dataloader(
    cfg: DatasetConfig,
    tokenizer: Any,
    *,
    max_prompt_length: int,
    seed: int = 0,
    split: str = "train",
    batch_size: int | None = None,
    num_examples: int | None = None,
) -> PromptDataLoader:
    """A ``PromptDataLoader`` over ``build_dataset(cfg, ...)``; the test split is not shuffled."""
    records = build_dataset(cfg, seed=seed, split=split, num_examples=num_examples)
    if split == "test" and num_examples is not None:
        records = records[:num_examples]
    return PromptDataLoader(
        records,
        tokenizer,
        batch_size=batch_size or cfg.train_batch_size,
        max_prompt_length=max_prompt_length,
        seed=seed,
        shuffle=cfg.shuffle and split == "train",
        drop_last=split == "train",
        prompt_template=cfg.prompt_template,
        use_chat_template=cfg.use_chat_template,
    )
