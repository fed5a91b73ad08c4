"""The native engine's prefill: left-padded contexts into cache slots, small ones replayed from CUDA graphs.

An eager prefill of a few tokens is all host time (one Python dispatch per op of every HF module; measured in
decision 0013), paid once per ``generate`` and per admission under continuous batching. So a prefill of at most :data:`PREFILL_GRAPH_TOKENS` padded tokens
runs at a bucketed shape and is captured once per shape, in its own graph pool
(:class:`~lumenrl_backends.engines.graphs.DecodeGraphs`: the first call runs eagerly, then it is captured):

* rows: up to a decode bucket, and to at least :data:`PREFILL_MIN_TOKENS` padded tokens' worth (a prefill that
  small is bound by its launches, not by its rows, and each shape is a capture, paid inside a run: the asynchronous
  rollouter's admissions of 1 to 16 prompts are one or two shapes, not five); the extra rows repeat the last row
  (same slot, same K/V written twice);
* width: up to a power of two >= 16, by more left padding (masked keys, so the math is unchanged; the
  response then starts at that column). Powers of two bound the number of graphs (a few widths x the row
  buckets) and at most double a prefill that is launch-bound anyway;
* the graph key also holds the hidden layers asked for (speculative decoding's draft features).

Eager at its own width instead: with R3 route recording (host-side bookkeeping per prefill), exact log-probs
(the trainer's batch-invariant operators at the trainer's shapes), an FP8 cache that calibrates its scales
at this prefill (host reads), or where the padded width would leave fewer than ``room`` columns (what the
caller generates) in ``max_seq_len``. ``Prefill.buckets`` follows the engine's graphs; a CPU test may set it
to run the bucketed shapes eagerly (their results equal a prefill at the contexts' own width).

Packed (:meth:`Prefill.packed`, the engine's ``pack_prefill``): a prefill too large for a graph, which is all
device time, runs its contexts back to back in one batch row with no padding, each token written to its own slot
and column (a row's tokens at columns ``0..len - 1``, its response from column ``len``). Rows continued after a
weight update are re-prefilled so (partial rollout: contexts from a prompt's length to the response cap): one
eager forward over their real tokens instead of one per group of like lengths, each left-padded up to twice its
rows' tokens. Attention is torch's varlen flash attention where :func:`~lumenrl_backends.engines.attention.varlen_ok`
holds (CUDA, 16-bit), else ``sdpa`` under a block-diagonal causal mask: (T, T) for T packed tokens, which
costs more than the padded path's per-row (W, W) masks, so ``pack_prefill="auto"`` (the default) packs only
where the varlen kernel runs, and ``"on"`` everywhere (the CPU tests of the packed path). Not with the eager
cases above (R3, exact log-probs, calibration), a sliding window, or draft features (``layer_ids``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lumenrl_backends.engines.attention import varlen_ok
from lumenrl_backends.engines.graphs import DecodeGraphs
from lumenrl_backends.engines.kv_cache import CacheView, packed_mask, prefill_mask
from lumenrl_backends.engines.requests import Request, left_pad
from lumenrl_sddd.capture import select_hidden

__all__ = ["Prefill", "PREFILL_GRAPH_TOKENS", "PREFILL_MIN_TOKENS"]

PREFILL_GRAPH_TOKENS = 2048  # prefills up to this many padded tokens replay a captured graph (module doc)
PREFILL_MIN_TOKENS = 256  # a graphed prefill's rows are bucketed up to at least this many padded tokens


class Prefill:
    """``prefill(contexts, rows, room=..., layer_ids=...)`` for one :class:`~lumenrl_backends.engines.NativeEngine`."""

    def __init__(self, engine: Any, *, graphs: bool, pack: str = "off") -> None:
        self.engine = engine
        self.graphs = DecodeGraphs(self._step, enabled=graphs, collect=getattr(engine, "ordinal", 1) > 0)
        self.buckets = graphs  # bucketed shapes (module doc)
        self._inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.eager = {"calls": 0, "seconds": 0.0}  # prefills at their own shape (host seconds: what they queue)
        self.pack = pack  # the engine's ``pack_prefill``: auto, on or off
        self.packed_calls = 0
        config = engine.model.config
        same_dims = getattr(config, "v_head_dim", None) is None and getattr(config, "kv_lora_rank", None) is None
        self._head_dim = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                          ) if same_dims else 0  # 0: q/k and v head sizes differ (MLA): no varlen kernel

    def __call__(
        self, contexts: list[list[int]], rows: torch.Tensor, *, room: int, layer_ids: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Left-pad ``contexts`` into cache slots ``rows`` (n,) and run the prefill forward (R3 records it) ->
        (ids, mask, positions: (n, W) at the padded width W, last-column logits (n, V), the hidden states of
        ``layer_ids`` (n, W, len * H) or None). ``room``: the columns the caller will fill after the context."""
        e, n = self.engine, len(contexts)
        key = self.key(n, max(len(c) for c in contexts), room)
        ids, mask = left_pad(contexts, e.pad_token_id, e.device, width=key[1] if key else 0)
        if key is not None and key[0] > n:  # bucket rows: the last row again
            ids, mask, rows = (torch.cat([t, t[-1:].expand(key[0] - n, *t.shape[1:])]) for t in (ids, mask, rows))
        width = ids.shape[1]
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        e.cache.clear_slots(rows)
        e.cache.valid[rows, :width] = mask.bool()
        e.routes.prefill(rows, width, [width - len(c) for c in contexts])
        hidden_key = tuple(layer_ids) if layer_ids is not None else None
        if key is None:
            start = time.perf_counter()
            logits, hidden = self._compute(ids, mask, positions, rows, hidden_key)
            self.eager["calls"] += 1
            self.eager["seconds"] += time.perf_counter() - start
        else:
            fresh = {"ids": ids, "mask": mask, "positions": positions, "rows": rows}
            inputs = self._inputs.get(key)
            if inputs is None:  # the graph's static inputs of this shape, made once
                inputs = self._inputs[key] = {name: torch.empty_like(value) for name, value in fresh.items()}
            for name, value in fresh.items():
                inputs[name].copy_(value)
            logits, hidden = self.graphs(*key, hidden_key)
        return ids[:n], mask[:n], positions[:n], logits[:n], None if hidden is None else hidden[:n]

    def chunks(self, admitted: list[Request]) -> list[list[Request]]:
        """Consecutive groups of requests whose left-padded size (rows x longest context) fits the engine's
        ``prefill_chunk_tokens``; a row under half its group's width starts a new group (with rows ordered longest
        first: at most twice the real tokens each)."""
        budget = self.engine.prefill_chunk_tokens
        chunks: list[list[Request]] = []
        current: list[Request] = []
        width = 0
        for request in admitted:
            grown = max(width, len(request.context))
            if current and (grown * (len(current) + 1) > budget or 2 * len(request.context) < width):
                chunks.append(current)
                current, grown = [], len(request.context)
            current.append(request)
            width = grown
        return chunks + ([current] if current else [])

    def plan(self, admitted: list[Request], room: int) -> list[tuple[list[Request], bool]]:
        """(chunk, packed) pairs: the left-padded chunks of :meth:`chunks`; where :meth:`packable`, the ones that no
        graph holds run packed instead, back to back in chunks of at most ``prefill_chunk_tokens`` real tokens."""
        chunks = self.chunks(admitted)
        if not self.packable():
            return [(chunk, False) for chunk in chunks]
        graphed, rest = [], []
        for chunk in chunks:
            fits = self.key(len(chunk), max(len(r.context) for r in chunk), room) is not None
            (graphed if fits else rest).append(chunk)
        packed: list[list[Request]] = []
        tokens = 0
        for request in (r for chunk in rest for r in chunk):
            if not packed or tokens + len(request.context) > self.engine.prefill_chunk_tokens:
                packed.append([])
                tokens = 0
            packed[-1].append(request)
            tokens += len(request.context)
        return [(chunk, True) for chunk in packed] + [(chunk, False) for chunk in graphed]

    def packable(self) -> bool:
        """Whether prefills too large for a graph run packed: ``pack`` on, or auto where the varlen kernel runs, and
        none of the cases that keep the padded path (module doc)."""
        e = self.engine
        if self.pack == "off" or e.exact or e.routes.enabled or self._calibrating() or e.window is not None or e._mixed_layers:
            return False
        return self.pack == "on" or self._varlen()

    def _varlen(self) -> bool:
        """Whether a packed prefill's attention runs torch's varlen kernel (else a block-diagonal mask)."""
        e = self.engine
        return self._head_dim > 0 and varlen_ok(e.device, next(e.model.parameters()).dtype, self._head_dim)

    def packed(self, contexts: list[list[int]], rows: torch.Tensor) -> torch.Tensor:
        """Prefill ``contexts`` back to back into cache slots ``rows`` (n,), each at columns 0..len - 1 -> the
        logits of each context's last token (n, V) (module doc)."""
        e, device = self.engine, self.engine.device
        lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int64)
        total = int(lengths.sum())
        ids = torch.tensor([t for c in contexts for t in c], dtype=torch.int64).to(device, non_blocking=True)[None]
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device, non_blocking=True)[None]
        lengths = lengths.to(device, non_blocking=True)
        token_rows = torch.repeat_interleave(rows, lengths, output_size=total)[None]  # (1, T)
        segments = torch.zeros(len(contexts) + 1, dtype=torch.int32, device=device)
        segments[1:] = lengths.cumsum(0)
        e.cache.clear_slots(rows)
        e.cache.valid[token_rows, positions] = True
        start = time.perf_counter()
        varlen = self._varlen()
        if varlen:  # the kernel reads the offsets, not the mask: a broadcast view of one value, no memory
            allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, total, total)
        else:
            allowed = packed_mask(lengths, total)
        e.cache.set_view(CacheView(rows=token_rows, columns=positions, decode=False, kv_len=total, segments=segments,
                                   longest=max(len(c) for c in contexts), varlen=varlen))
        out = e._forward(ids, positions, allowed, allowed, logits_to_keep=(segments[1:] - 1).long())
        self.packed_calls += 1
        self.eager["calls"] += 1
        self.eager["seconds"] += time.perf_counter() - start
        return out.logits[0]

    def _calibrating(self) -> bool:
        cache = self.engine.cache
        return cache.kv_dtype is not None and (
            cache.recalibrate or any(layer.codec.scales is None for layer in cache.layers))

    def key(self, n: int, width: int, room: int) -> tuple[int, int] | None:
        """(rows bucket, width bucket) of a graphed prefill, or None: eager at its own shape (module doc)."""
        e = self.engine
        if not self.buckets or e.exact or e.routes.enabled or self._calibrating():
            return None
        padded = max(16, 1 << (width - 1).bit_length())
        least = max(n, PREFILL_MIN_TOKENS // padded)  # n <= the largest bucket, which bounds ``least``'s bucket
        rows = next((b for b in e.buckets if b >= least), e.buckets[-1])
        if rows * padded > PREFILL_GRAPH_TOKENS or padded + room > e.max_seq_len:
            return None
        return rows, padded

    def _step(self, rows: int, width: int, layer_ids: tuple[int, ...] | None) -> tuple[Any, ...]:
        """What a graph holds: :meth:`_compute` over the static inputs of its shape."""
        inputs = self._inputs[(rows, width)]
        return self._compute(inputs["ids"], inputs["mask"], inputs["positions"], inputs["rows"], layer_ids)

    def _compute(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 layer_ids: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        e, width = self.engine, ids.shape[1]
        columns = torch.arange(width, device=ids.device).expand(rows.shape[0], width)
        e.cache.set_view(CacheView(rows=rows, columns=columns, decode=False, kv_len=width))
        out = e._forward(ids, positions, prefill_mask(mask, e.window), prefill_mask(mask, None), layer_ids=layer_ids)
        hidden = None if layer_ids is None else select_hidden(out.hidden_states, list(layer_ids))
        return out.logits[:, -1], hidden
