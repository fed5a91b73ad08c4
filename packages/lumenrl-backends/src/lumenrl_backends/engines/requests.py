"""Per-sequence rollout state, read from an input DataProto and written back as the rollout batch.

Shared by every engine so they all emit the same layout (docs/decisions/0001-contracts.md):
``prompts`` (B, P) left-padded, ``responses``/``response_mask``/``rollout_log_probs`` (B, T)
right-padded with T = ``max_new_tokens``, ``input_ids``/``attention_mask``/``position_ids``
(B, P + T), non-tensor ``response_text``, ``finish_reason`` ("stop", "length", "interrupted"),
with R3 recording ``routed_experts`` (B, P + T, L_moe, k) (:mod:`~lumenrl_backends.engines.routes`)
and ``seed`` (the per-request sampling seed used; an input column ``sampling_seed`` sets it
explicitly, otherwise row i gets ``sampling.seed + i``). An optional input column
``max_new_tokens`` caps a row's response below ``sampling.max_new_tokens`` (native engine;
used by the long-tail benchmark).

A batch returned with ``meta_info["interrupted"] = True`` is itself a valid input: rows whose
``finish_reason`` is "interrupted" continue from their partial response (keeping its tokens and
log-probs), finished rows pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from lumenrl_backends.engines.sampling import SamplingParams

__all__ = [
    "Request",
    "requests_from_batch",
    "build_rollout_batch",
    "decode_texts",
    "generated_tokens",
    "group_by_context",
    "left_pad",
    "rollout_meta",
    "stop_ids_for",
]

STOP, LENGTH, INTERRUPTED = "stop", "length", "interrupted"


@dataclass(kw_only=True, slots=True)
class Request:
    index: int  # row in the caller's batch
    prompt: list[int]  # prompt ids without padding
    seed: int
    response: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; "interrupted" when cut short
    max_new_tokens: int | None = None  # per-row cap (input column ``max_new_tokens``), None: the sampling's
    routes: Any = None  # R3: (context + response - 1, L_moe, k) int expert ids, when recorded
    route_probs: Any = None  # R3: (..., L_moe, E) router probabilities, with record_router_logits

    @property
    def done(self) -> bool:
        return self.finish_reason in (STOP, LENGTH)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.response

    def cap(self, params: SamplingParams) -> int:
        """The most response tokens this row may have (its own cap within the sampling's)."""
        return min(params.max_new_tokens, self.max_new_tokens or params.max_new_tokens)


def stop_ids_for(params: SamplingParams, eos_token_ids: list[int]) -> frozenset[int]:
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    return frozenset(stops)


def group_by_context(requests: list[Request]) -> tuple[list[Request], dict[int, list[Request]]]:
    """(the first request of each distinct context, in order; {id(first): the later requests of its context}): the
    rows a shared prefill computes, and the rows that copy each one's cache (the native engine's ``share_prefill``)."""
    first: dict[tuple[int, ...], Request] = {}
    copies: dict[int, list[Request]] = {}
    for request in requests:
        lead = first.setdefault(tuple(request.context), request)
        if lead is not request:
            copies.setdefault(id(lead), []).append(request)
    return list(first.values()), copies


def generated_tokens(requests: list[Request]) -> int:
    return sum(len(r.response) for r in requests)


def rollout_meta(
    requests: list[Request],
    params: SamplingParams,
    *,
    weight_version: int,
    tokens: int,
    seconds: float,
    **perf: Any,
) -> dict[str, Any]:
    """A rollout batch's ``meta_info``: interrupted flag, weight version, temperature and ``perf``
    (``tokens`` generated in ``seconds``, their rate, plus the engine's own ``perf`` entries)."""
    return {
        "interrupted": any(r.finish_reason is None for r in requests),
        "weight_version": weight_version,
        "temperature": float(params.temperature),
        "perf": {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), **perf},
    }


def _row_seeds(batch: Any, params: SamplingParams, rows: int, continuing: bool) -> list[int]:
    """Continuation: the seeds the batch was generated with. Fresh rows: an explicit per-request
    ``sampling_seed`` column, else ``sampling.seed + row``, else a base drawn from torch's RNG.
    (A stale ``seed`` column on a fresh batch is ignored: repeated rows would share it.)"""
    if continuing:
        return [int(s) for s in batch.non_tensor_batch["seed"]]
    if "sampling_seed" in batch.non_tensor_batch:
        return [int(s) for s in batch.non_tensor_batch["sampling_seed"]]
    if params.seed is not None:
        return [params.seed + i for i in range(rows)]
    base = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
    return [base + i for i in range(rows)]


def _unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    keep = mask.cpu().numpy().astype(bool)  # numpy: no torch operator per row on the host's path
    return [row[m].tolist() for row, m in zip(ids.cpu().numpy(), keep)]


def requests_from_batch(
    batch: Any, params: SamplingParams
) -> tuple[list[Request], torch.Tensor, torch.Tensor]:
    """Requests plus the (B, P) left-padded prompt ids and mask to echo back in the output."""
    rows = len(batch)
    continuing = bool(batch.meta_info.get("interrupted")) and "responses" in batch.batch
    seeds = _row_seeds(batch, params, rows, continuing)
    if continuing:
        prompts = batch.batch["prompts"]
        prompt_mask = batch.batch["attention_mask"][:, : prompts.shape[1]]
        responses = _unpad(batch.batch["responses"], batch.batch["response_mask"])
        log_probs = _unpad(batch.batch["rollout_log_probs"], batch.batch["response_mask"])
        reasons = batch.non_tensor_batch["finish_reason"]
    else:
        prompts, prompt_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        responses, log_probs, reasons = [[] for _ in range(rows)], [[] for _ in range(rows)], [None] * rows
    caps = batch.non_tensor_batch.get("max_new_tokens")
    requests = [
        Request(
            index=i,
            prompt=p,
            seed=seeds[i],
            response=list(r),
            log_probs=list(lp),
            finish_reason=reason if reason in (STOP, LENGTH) else None,
            max_new_tokens=None if caps is None else int(caps[i]),
        )
        for i, (p, r, lp, reason) in enumerate(
            zip(_unpad(prompts, prompt_mask), responses, log_probs, reasons)
        )
    ]
    empty = [r.index for r in requests if not r.prompt]
    if empty:
        raise ValueError(
            f"generate: rows {empty[:8]} have an all-zero attention_mask; every row needs at least one prompt token"
        )
    return requests, prompts, prompt_mask


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad lists of ids -> ids (n, L) int64 and mask (n, L) int64; L = the longest, or ``width`` if larger."""
    from lumenrl_backends.engines.routes import row_ranges

    lengths = [len(s) for s in sequences]
    rows, width = len(sequences), max(width, max(lengths))
    # one scatter of the flattened ids (numpy, no loop of torch operators over rows), then one copy each
    filled = row_ranges([(i + 1) * width - n for i, n in enumerate(lengths)], lengths).numpy()
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    ids.reshape(-1)[filled] = np.fromiter(chain.from_iterable(sequences), np.int64, filled.size)
    mask.reshape(-1)[filled] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def decode_texts(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=True)``. For a fast (Rust-backed) tokenizer that
    does no space clean-up, that is its backend's decode of each sequence, called directly: transformers'
    ``batch_decode`` first walks every id of the batch in Python (twice), a cost on the host's path between the
    rollout's last step and the update."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return [backend.decode(seq, skip_special_tokens=True) for seq in sequences]
    return tokenizer.batch_decode(sequences, skip_special_tokens=True)


def build_rollout_batch(
    requests: list[Request],
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    width: int,
    pad_id: int,
    tokenizer: Any,
    meta_info: dict[str, Any],
) -> Any:
    """Assemble the rollout DataProto (layout in the module docstring)."""
    from lumenrl_backends.engines.routes import routes_column, row_ranges
    from lumenrl_core.data_proto import DataProto

    rows, width = len(requests), max([width] + [len(r.response) for r in requests])
    # numpy throughout: host bookkeeping between the rollout's last step and the update, no torch CPU operator
    # every response at the start of its row: one array per column from the flattened lists, one scatter each
    filled = row_ranges([r.index * width for r in requests], [len(r.response) for r in requests]).numpy()
    responses = np.full((rows, width), pad_id, dtype=np.int64)
    response_mask = np.zeros((rows, width), dtype=np.int64)
    log_probs = np.zeros((rows, width), dtype=np.float32)
    responses.reshape(-1)[filled] = np.fromiter(chain.from_iterable(r.response for r in requests), np.int64, filled.size)
    response_mask.reshape(-1)[filled] = 1
    log_probs.reshape(-1)[filled] = np.fromiter(chain.from_iterable(r.log_probs for r in requests), np.float32,
                                                filled.size)
    prompts_np = prompts.cpu().to(torch.int64).numpy()
    attention_mask = np.concatenate([prompt_mask.cpu().to(torch.int64).numpy(), response_mask], axis=1)
    arrays = {
        "prompts": prompts_np,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts_np, responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0),
        "rollout_log_probs": log_probs,
    }
    tensors = {**{k: torch.from_numpy(v) for k, v in arrays.items()},
               **routes_column(requests, prompts_np.shape[1], width)}
    texts = decode_texts(tokenizer, [r.response for r in requests])
    non_tensors = {
        "response_text": np.array(texts, dtype=object),
        "finish_reason": np.array([r.finish_reason or INTERRUPTED for r in requests], dtype=object),
        "seed": np.array([r.seed for r in requests], dtype=np.int64),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)
