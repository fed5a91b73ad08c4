"""Rollout: prompts -> n responses per prompt, grouped by ``uid``; the dynamic-sampling fill loop.

A prompt batch from the dataloader is expanded to ``n`` interleaved copies (rows
``[p0, p0, ..., p1, p1, ...]``), each group tagged with one ``uid``, and handed to the rollout
engine. Sampling seeds are derived from (run seed, step, generation round), never from a
global RNG, so a resumed run regenerates exactly what an uninterrupted one would.

With DAPO dynamic sampling, groups whose rewards are all equal (zero advantage, no gradient)
are dropped and further prompt batches are generated, at most ``algorithm.max_num_gen_batches``
rounds, until ``train_batch_size`` groups are kept; the batch is then cut to exactly that many
groups (or, if the bound is hit, trained on what was kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from lumenrl_core.algorithms import DynamicSamplingState, dynamic_sampling_keep_indices, outcome_scores
from lumenrl_core.data_proto import DataProto

__all__ = [
    "RolloutResult",
    "sampling_seed",
    "expand_groups",
    "generate",
    "collect_rollouts",
    "keep_first_groups",
    "concat_rounds",
]

# Keys of the sampling config the engine reads (``n`` is applied here, by repetition).
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos")


def sampling_seed(run_seed: int, step: int, round_index: int) -> int:
    """A distinct, reproducible engine seed per (run, step, generation round); rows add their index."""
    return (int(run_seed) * 1_000_003 + int(step) * 7919 + int(round_index) * 104_729) % (2**31 - 1)


def expand_groups(prompts: DataProto, n: int, group_tag: str) -> DataProto:
    """Tag each prompt with ``uid = f"{group_tag}-{i}"`` and repeat it ``n`` times, interleaved."""
    if n < 1:
        raise ValueError(f"policy.rollout.n={n!r} must be >= 1")
    prompts["uid"] = np.array([f"{group_tag}-{i}" for i in range(len(prompts))], dtype=object)
    return prompts.repeat(n, interleave=True)


def generate(engine: Any, batch: DataProto, sampling: Mapping[str, Any], seed: int) -> DataProto:
    """``engine.generate`` with the per-call seed; per-row fields of ``batch`` are carried over. A
    ``max_new_tokens`` column (a dataset field: each prompt's own response budget) needs an engine that
    reads it (capability ``row_max_new_tokens``); others refuse it rather than ignore it."""
    if "max_new_tokens" in batch.non_tensor_batch and "row_max_new_tokens" not in getattr(engine, "capabilities", ()):
        raise ValueError(f"the dataset's max_new_tokens field (a per-prompt response cap) is not read by the "
                         f"{type(engine).__name__} rollout engine; allowed: policy.rollout_engine=native, or "
                         f"a dataset without that field")
    params = {k: sampling[k] for k in _SAMPLING_KEYS if k in sampling}
    out = engine.generate(batch, {**params, "seed": seed})
    for key, values in batch.non_tensor_batch.items():
        if key not in out.non_tensor_batch:
            out[key] = values
    out.meta_info.setdefault("temperature", float(sampling.get("temperature", 1.0)))
    return out


def keep_first_groups(batch: DataProto, num_groups: int) -> DataProto:
    """The rows of the first ``num_groups`` distinct uids (rows of a group are contiguous)."""
    uids = batch.non_tensor_batch["uid"]
    seen: dict[Any, None] = {}
    keep = []
    for row, uid in enumerate(uids):
        if uid not in seen and len(seen) >= num_groups:
            break
        seen.setdefault(uid, None)
        keep.append(row)
    return batch[np.asarray(keep, dtype=np.int64)]


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    """The scored train batch of one step and what it took to make it."""

    batch: DataProto
    metrics: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    generate_s: float = 0.0
    score_s: float = 0.0  # the reward function and its text decoding


def collect_rollouts(
    *,
    next_prompts: Callable[[], DataProto],
    engine: Any,
    score: Callable[[DataProto], dict[str, float]],
    sampling: Mapping[str, Any],
    n: int,
    run_seed: int,
    step: int,
    target_groups: int,
    dynamic_sampling: bool,
    max_num_gen_batches: int,
) -> RolloutResult:
    """Generate and score one step's batch; with ``dynamic_sampling``, refill dropped groups.

    ``score(batch)`` must write ``token_level_scores`` into ``batch`` and return metrics; the
    metrics of the first round describe the policy (reward before filtering).
    """
    state = DynamicSamplingState(target_groups=target_groups, max_num_gen_batches=max_num_gen_batches)
    kept: list[DataProto] = []
    result = RolloutResult(batch=DataProto())
    for round_index in _rounds(dynamic_sampling, state):
        with record_function("lumenrl/prompts"):  # ranges of a torch.profiler trace, as PhaseTimer's phases
            rows = expand_groups(next_prompts(), n, group_tag=f"s{step}r{round_index}")
        start = time.perf_counter()
        with record_function("lumenrl/generate"):
            batch = generate(engine, rows, sampling, sampling_seed(run_seed, step, round_index))
        result.generate_s += time.perf_counter() - start
        result.generated_tokens += int(batch.batch["response_mask"].sum())
        start = time.perf_counter()
        with record_function("lumenrl/score"):
            metrics = score(batch)
        result.score_s += time.perf_counter() - start
        if round_index == 0:
            result.metrics.update(metrics)
        if dynamic_sampling:
            batch = _drop_uniform_groups(batch)
            state.record(len(set(batch.non_tensor_batch["uid"])))
        kept.append(batch)
    merged = concat_rounds(kept)
    if dynamic_sampling:
        result.metrics.update(state.metrics())
        merged = keep_first_groups(merged, target_groups) if state.full else merged
    result.batch = merged
    return result


def _rounds(dynamic_sampling: bool, state: DynamicSamplingState) -> Iterator[int]:
    yield 0
    round_index = 1
    while dynamic_sampling and not state.done:
        yield round_index
        round_index += 1


def _drop_uniform_groups(batch: DataProto) -> DataProto:
    scores = outcome_scores(batch.batch["token_level_scores"], batch.batch["response_mask"])
    keep = dynamic_sampling_keep_indices(scores, list(batch.non_tensor_batch["uid"]))
    return batch[keep]


def _pad_dim1(t: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    if not (left or right):
        return t
    pad = [0, 0] * (t.dim() - 2) + [left, right]  # F.pad lists the last dim first
    return F.pad(t, pad, value=value)


def _pad_routes(t: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """(B, P+T, L_moe, k) routes padded on the token dim with rows 0..k-1."""
    row = torch.arange(t.shape[-1], dtype=t.dtype, device=t.device)
    parts = [row.expand(t.shape[0], left, *t.shape[2:]), t, row.expand(t.shape[0], right, *t.shape[2:])]
    return torch.cat(parts, dim=1)


def _align(batch: DataProto, prompt_width: int, response_width: int, pad_token_id: int) -> DataProto:
    """Left-pad the prompt part and right-pad the response part to the given widths."""
    batch = batch[:]  # a new DataProto: the caller's batch stays as it was
    P, T = batch.batch["prompts"].shape[1], batch.batch["responses"].shape[1]
    d_p, d_t = prompt_width - P, response_width - T
    for key, t in list(batch.batch.items()):
        value = pad_token_id if key in ("input_ids", "prompts", "responses") else 0
        if t.dim() < 2:
            continue
        if key == "prompts":
            batch.batch[key] = _pad_dim1(t, d_p, 0, value)
        elif key == "routed_experts":  # R3 pad rows list experts 0..k-1 (a row never repeats an expert)
            batch.batch[key] = _pad_routes(t, d_p, d_t)
        elif t.shape[1] == P + T and key not in ("responses",):
            batch.batch[key] = _pad_dim1(t, d_p, d_t, value)
        elif t.shape[1] == T:
            batch.batch[key] = _pad_dim1(t, 0, d_t, value)
    return batch


def concat_rounds(batches: list[DataProto], pad_token_id: int = 0) -> DataProto:
    """Concatenate the non-empty generation rounds, padding prompt/response widths to the widest.

    Rounds generate independently, so their prompt widths P and response widths T differ; a
    (B, P+T) key is padded on both sides, a (B, T) key on the right, ``prompts`` on the left.
    Padding is masked out (attention/response masks are 0 there).
    """
    parts = [b for b in batches if len(b)]
    if not parts:
        return batches[0]
    if len(parts) == 1:
        return parts[0]
    width_p = max(b.batch["prompts"].shape[1] for b in parts)
    width_t = max(b.batch["responses"].shape[1] for b in parts)
    return DataProto.concat([_align(b, width_p, width_t, pad_token_id) for b in parts])
