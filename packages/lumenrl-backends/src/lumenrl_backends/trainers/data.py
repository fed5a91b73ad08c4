"""Datasets of a run: train records, a disjoint held-out eval set, and their loaders.

``dataset.name``: ``arithmetic`` / ``countdown`` (generated in code by core's tasks; the
generation seed is fixed, so every run seed sees the same problems, and only the data *order*
follows the run ``seed``) or ``jsonl`` / ``parquet`` (``dataset.path``). Eval records are drawn
from the same task with another generation seed, excluding every train prompt (unless the task
is too small to have unseen problems, see ``_eval_records``); for a file
dataset they are the last ``eval.num_examples`` rows, held out of training.
"""

from __future__ import annotations

from typing import Any

from lumenrl_core.data.loader import PromptDataLoader
from lumenrl_core.data.records import load_records
from lumenrl_core.data.tasks import ArithmeticTask, CountdownTask

__all__ = ["TASK_SEED", "EVAL_TASK_SEED", "split_records", "make_loader"]

TASK_SEED = 0
EVAL_TASK_SEED = 1_000_003
_GENERATED = ("arithmetic", "countdown")


def _task(ds: Any, num_examples: int, seed: int) -> Any:
    if ds.name == "arithmetic":
        return ArithmeticTask(num_examples=num_examples, difficulty=ds.difficulty, seed=seed)
    return CountdownTask(num_examples=num_examples, seed=seed)


def _eval_records(ds: Any, n_eval: int, exclude: frozenset[str]) -> list[dict[str, Any]]:
    """Held-out problems when the task space has room for them; a small task (e.g. single-digit
    arithmetic, whose train set already holds nearly every problem) is evaluated on a fresh
    draw from the same distribution instead."""
    if not n_eval:
        return []
    try:
        held_out = _task(ds, n_eval, EVAL_TASK_SEED).records(exclude=exclude)
    except ValueError:
        held_out = []
    if len(held_out) < n_eval:
        return _task(ds, n_eval, EVAL_TASK_SEED).records()
    return held_out


def split_records(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) for ``cfg.dataset``; eval is held out of train (a task too
    small for unseen problems excepted, see ``_eval_records``)."""
    ds, n_eval = cfg.dataset, cfg.eval.num_examples if cfg.eval.enabled else 0
    if ds.name in _GENERATED:
        train = _task(ds, ds.num_examples, TASK_SEED).records()
        exclude = frozenset(str(r["prompt"]) for r in train)
        return train, _eval_records(ds, n_eval, exclude)
    if ds.name not in ("jsonl", "parquet"):
        raise ValueError(
            f"dataset.name={ds.name!r} is not supported; allowed: arithmetic, countdown, jsonl, parquet"
        )
    if not ds.path:
        raise ValueError(f"dataset.name={ds.name!r} needs dataset.path (a local .{ds.name} file)")
    rows = load_records(ds.path, fmt=ds.name, prompt_key=ds.prompt_key, answer_key=ds.answer_key)
    if n_eval and len(rows) > n_eval:
        return rows[:-n_eval], rows[-n_eval:]
    return rows, []


def make_loader(
    cfg: Any, records: list[dict[str, Any]], tokenizer: Any, *, batch_size: int, seed: int, shuffle: bool
) -> PromptDataLoader:
    """A :class:`PromptDataLoader` with the run's prompt rendering settings."""
    ds = cfg.dataset
    return PromptDataLoader(
        records,
        tokenizer,
        batch_size=batch_size,
        max_prompt_length=cfg.policy.max_prompt_length,
        seed=seed,
        shuffle=shuffle,
        prompt_template=ds.prompt_template,
        use_chat_template=ds.use_chat_template,
    )
