"""Speculative decoding in the native engine: draft k tokens, verify them in one target forward.

One round per batch (rows = the engine's cache slots 0..b-1)::

    draft.propose(committed tokens + their teacher features)  -> d_1..d_k, draft logits q    # chain / block
    target forward over [x_n, d_1..d_k] at cache columns c..c+k (the engine's SlotKVCache, decode
    view with k + 1 query columns; causal mask by column)  -> logits p_0..p_k, hidden states
    accept m tokens, then one more (the correction or bonus token)                               # m + 1 per round
    KV rollback: the next round writes from column c + m + 1; the k - m rejected columns are
    overwritten before any query can see them (the causal mask hides them until then)

Acceptance:

* greedy (temperature 0): d_i is accepted while it equals argmax p_{i-1}; the next token is
  argmax p_m. The output is the target's own greedy output token for token (tested).
* sampling (Leviathan et al. 2023 / Chen et al. 2023): accept d_i with probability
  min(1, p(d_i) / q(d_i)); at the first rejection draw from norm(max(0, p - q)); if all k pass,
  draw the bonus token from p_k. Every emitted token is then distributed exactly as the target's
  ``softmax(logits / T)`` (tested with a chi-square bound). Randomness: counter-based per request
  (its seed, its position, a stream per draw), as the plain engine's sampler, but other draws than
  the plain engine's. top-k / top-p are refused.

Log-probs are the target's ``log_softmax(logits / T)`` at each emitted token (temperature 1 for
greedy), the contracts' convention, from the verify forward. ``tau`` = tokens emitted per verify
forward (accepted + 1), averaged over live rows and rounds, goes to ``meta_info["speculative"]``.

Hidden-state capture (engine capability ``hidden_state_capture``): :func:`capture_hidden` runs the
engine's model over a batch through its cache and attention (prefill view) and returns the
lumenrl-sddd capture dict (chosen layers + logits), what the SDDD trainer's teacher sends.

Rounds (:class:`_Rounds`): the draft commits a chunk's prompt context once (eagerly), then every round
reads and writes static buffers only and is captured as one CUDA graph per (rows, kv_len, greedy) on
CUDA (``cuda_graphs`` on), with one host sync per round to read the emitted tokens. A round's state
advance happens on the device (the next round reads the accepted count from the buffers), so the host
queues round r + 1 *before* it reads round r (run-ahead, as the plain engine's overlapped decode): the
graph launch and the host's bookkeeping overlap the device's work. A row that finished in round r still
takes part in the run-ahead round r + 1 (the host learns it finished only after queueing it); those
tokens are discarded and the row is frozen from round r + 2 on. Run-ahead needs room for that extra
round in the cache (``max_seq_len``); without it the round is queued after the read. Sampling
noise is counter-based (``engines/sampling.py``'s hash of seed and position): reproducible per request,
independent of the batch, and capturable.

Limits (documented in docs/decisions/0013-sddd.md): batches run in lockstep rounds (no continuous
batching: rows that finish are frozen until the batch ends); no sliding-window models; no
interrupt/resume mid-batch.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import torch

from lumenrl_backends.engines.attention import engine_attention
from lumenrl_backends.engines.kv_cache import CacheView, prefill_mask, to_attention_mask
from lumenrl_backends.engines.requests import (
    LENGTH,
    STOP,
    build_rollout_batch,
    generated_tokens,
    requests_from_batch,
    rollout_meta,
    stop_ids_for,
)
from lumenrl_backends.engines.sampling import SamplingParams, uniform_noise
from lumenrl_sddd.capture import select_hidden

__all__ = ["attach_draft", "attach_from_config", "speculative_generate", "capture_hidden", "accept_greedy", "accept_sampling",
           "target_forward"]


def attach_draft(engine: Any, draft: Any, num_tokens: int, compile_draft: bool = True) -> None:
    """Make ``engine.generate`` decode speculatively with ``draft`` (None detaches). ``compile_draft``: on CUDA, an
    Eagle3 draft's chained steps run through torch.compile (``Eagle3Draft.compile_inference``; DFlash drafts a
    block in one forward and has no chained steps)."""
    if draft is not None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if engine.window is not None:
            raise ValueError("speculative decoding does not support sliding-window attention models")
        if engine.routes.enabled:
            raise ValueError("speculative decoding does not record MoE routes (R3: its verify forwards would leave "
                             "the drafted tokens' routes unrecorded); allowed: moe.r3.enabled=false")
        if getattr(engine, "exact", False):
            raise ValueError("speculative decoding cannot give exact_logprobs (its verify forward is not the "
                             "trainer's batch-invariant path); allowed: policy.rollout.exact_logprobs=false")
        dtype = next(engine.model.parameters()).dtype
        draft = draft.to(engine.device, dtype).eval()
        if hasattr(draft, "compile_inference"):
            draft.compile_inference("inductor" if compile_draft and engine.device.type == "cuda" else None)
    engine.draft, engine.spec_tokens = draft, num_tokens
    engine.spec_rounds = None  # buffers and graphs of the previous draft (its parameters may have moved)


def attach_from_config(engine: Any, spec: Any) -> None:
    """``policy.rollout.speculative``: load the draft at ``draft_path`` (lumenrl-sddd export) and attach it
    (an empty ``draft_path``: nothing to do)."""
    if not spec.draft_path:
        return
    from lumenrl_sddd.export import load_draft

    draft = load_draft(spec.draft_path)
    k = spec.num_draft_tokens
    if draft.kind == "dflash" and k != draft.config.block_size - 1:
        raise ValueError(f"policy.rollout.speculative.num_draft_tokens={k}: the DFlash draft at {spec.draft_path} "
                         f"drafts block_size - 1 = {draft.config.block_size - 1} tokens; set it to that")
    attach_draft(engine, draft, k, compile_draft=spec.compile_draft)


def target_forward(engine: Any, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor, *, decode: bool,
                   kv_len: int, allowed: torch.Tensor, layer_ids: list[int], last_only: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the engine's model over rows 0..b-1 -> (logits (b, q|1, V), hidden (b, q, n * H))."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    engine.cache.set_view(CacheView(rows=rows, columns=columns, decode=decode, kv_len=kv_len))
    mask = to_attention_mask(allowed, engine._attn, next(engine.model.parameters()).dtype)
    try:
        with engine_attention(engine.cache):
            out = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                               output_hidden_states=True, logits_to_keep=1 if last_only else 0,
                               **{engine._cache_kwarg: engine.cache})
    finally:
        engine.cache.set_view(None)
    return out.logits, select_hidden(out.hidden_states, layer_ids)


@torch.no_grad()
def capture_hidden(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """Teacher capture through the engine (prefill view over slots 0..b-1, in chunks of max_batch_size)."""
    parts = []
    for start in range(0, input_ids.shape[0], engine.max_batch_size):
        ids = input_ids[start:start + engine.max_batch_size].to(engine.device)
        mask = attention_mask[start:start + engine.max_batch_size].to(engine.device)
        n, width = ids.shape
        rows = torch.arange(n, device=engine.device)
        engine.cache.clear_slots(rows)
        engine.cache.valid[rows, :width] = mask.bool()
        columns = torch.arange(width, device=engine.device).expand(n, width)
        logits, hidden = target_forward(engine, ids, (mask.cumsum(1) - 1).clamp(min=0), columns, decode=False,
                                        kv_len=width, allowed=prefill_mask(mask), layer_ids=layer_ids)
        engine.cache.clear_slots(rows)
        parts.append({"input_ids": ids.cpu(), "attention_mask": mask.long().cpu(), "hidden": hidden.float().cpu(),
                      "logits": logits.float().cpu()})
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def accept_greedy(drafted: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafted (b, k), target logits (b, k + 1, V) -> (accepted m (b,), next token (b,))."""
    best = logits.argmax(-1)  # (b, k + 1)
    m = (drafted == best[:, :-1]).long().cumprod(1).sum(1)
    return m, best.gather(1, m[:, None])[:, 0]


def accept_sampling(drafted: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor, gumbel: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafted (b, k), draft probs q (b, k, V), target probs p (b, k + 1, V), uniforms u (b, k) and Gumbel
    noise (b, V), independent of each other and of the draft's draws -> (m (b,), next token (b,))."""
    k = drafted.shape[1]
    pd = p[:, :k].gather(2, drafted[..., None])[..., 0]
    qd = q.gather(2, drafted[..., None])[..., 0]
    m = (u * qd < pd).long().cumprod(1).sum(1)  # accept with probability min(1, p / q)
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # all accepted: q = 0, residual = p_k
    index = m[:, None, None].expand(-1, 1, p.shape[-1])
    p_m, q_m = p.gather(1, index)[:, 0], q_pad.gather(1, index)[:, 0]
    residual = (p_m - q_m).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q exactly: no residual mass, p itself
    residual = torch.where(empty, p_m, residual)
    return m, (residual.log() + gumbel).argmax(-1)  # Gumbel-max: a draw from residual / residual.sum()


def _gumbel(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    return -(-uniform_noise(seeds, counters, width).log()).log()


# Noise streams (counter-based, as engines/sampling.py): counter = response index * _STREAMS + stream;
# stream j < k for the j-th draft draw of a round, _ACCEPT for its acceptance uniforms, _RESIDUAL for its
# correction / bonus draw (and the first token's draw). A row's draws depend on its seed and position only.
_STREAMS, _ACCEPT, _RESIDUAL = 4096, 4094, 4095


class _Rounds:
    """Static buffers of speculative rounds over slots 0..n-1 and the CUDA graphs of one round.

    One round (:meth:`step`) is draft (k chained steps) + verify forward + acceptance + the state
    advance. It reads and writes only these buffers, the draft's state and the engine's slot cache, so a
    captured graph (key: rows, kv_len, greedy) replays with fresh values at the same addresses. Every
    round goes through :class:`~lumenrl_backends.engines.graphs.DecodeGraphs` (eager where the engine's
    graphs are off); a chunk's prompt context is committed to the draft first (:meth:`load_context`)."""

    def __init__(self, engine: Any, draft: Any, k: int) -> None:
        from lumenrl_backends.engines.graphs import DecodeGraphs

        rows, device = engine.max_batch_size, engine.device
        self.engine, self.draft, self.k = engine, draft, k
        self.state = draft.start(rows, engine.max_seq_len, device)
        long = dict(dtype=torch.long, device=device)
        self.cur, self.last, self.col, self.pos = (torch.zeros(rows, **long) for _ in range(4))
        self.seeds, self.counters = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.inputs: dict[str, torch.Tensor] = {
            "tokens": torch.zeros(rows, k + 1, **long), "columns": torch.ones(rows, k + 1, **long),
            "positions": torch.zeros(rows, k + 1, **long),
            "valid": torch.zeros(rows, k + 1, dtype=torch.bool, device=device)}  # + "features" at the first chunk
        self.steps = torch.arange(k + 1, device=device)
        # no recording: a compiled draft (or verify forward) may compile again for a new key, not inside a capture
        self.graphs = DecodeGraphs(self._graph_step, enabled=engine.graphs.enabled and engine.graphs.error is None,
                                   record=False)
        pinned = device.type == "cuda"
        # two host buffers (run-ahead: round r + 1 is queued before round r is read), (rows, 2k + 3) each
        self._host = [torch.empty(rows * (2 * k + 3), dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._live_host = torch.ones(rows, dtype=torch.bool, pin_memory=pinned)
        self._flip = 0

    def launch(self, n: int, kv_len: int, greedy: bool) -> tuple[torch.Tensor, Any]:
        """Queue one round over rows 0..n-1 and the copy of its result to a host buffer (no host sync);
        returns (the (n, 2k + 3) host view, the event to wait for before reading it)."""
        packed = self.graphs(n, kv_len, greedy)[:n]
        buffer, event = self._host[self._flip], self._events[self._flip]
        self._flip ^= 1
        view = buffer[: packed.numel()].view(packed.shape)
        view.copy_(packed, non_blocking=event is not None)
        if event is not None:
            event.record()
        return view, event

    def set_live(self, live: list[bool]) -> None:
        """Which rows are still generating, for the rounds queued from now on (a copy in stream order).
        The pinned source may be rewritten before an earlier copy ran: harmless, rows only ever stop (a newer
        list marks a superset of finished rows, and a finished row's results are discarded anyway)."""
        n = len(live)
        self._live_host[:n] = torch.tensor(live)
        self.live[:n].copy_(self._live_host[:n], non_blocking=self.live.is_cuda)

    def draft_state(self, n: int) -> Any:
        return type(self.state)(*(getattr(self.state, f.name)[:n] for f in fields(self.state)))

    def load_context(self, n: int, context: dict[str, torch.Tensor]) -> None:
        """A chunk's prompt context (entries (n, width), the first token appended) -> the draft's state and the
        round inputs: all but the last k + 1 entries are committed here, those k + 1 (the first entry repeated
        when the prompt is shorter: re-committing an entry is idempotent) are the first round's inputs."""
        width = context["tokens"].shape[1]
        if width > self.k + 1:
            self.draft.commit(self.draft_state(n), **{key: value[:, :width - self.k - 1] for key, value in context.items()})
        window = (torch.arange(self.k + 1, device=self.cur.device) + width - self.k - 1).clamp(min=0)
        if "features" not in self.inputs:  # the teacher features' width is known once a chunk is prefilled
            self.inputs["features"] = context["features"].new_zeros(self.cur.shape[0], self.k + 1,
                                                                    context["features"].shape[-1])
        for key, value in context.items():
            self.inputs[key][:n].copy_(value[:, window])
        self.last[:n].fill_(self.k)

    def _graph_step(self, n: int, kv_len: int, greedy: bool) -> torch.Tensor:
        inputs = {**{key: value[:n] for key, value in self.inputs.items()}, "last": self.last[:n]}
        return self.step(n, kv_len, greedy, inputs)

    def _sampler(self, n: int, greedy: bool):
        calls = iter(range(self.k))  # the j-th call draws the j-th draft token (its own noise stream)

        def sample(logits: torch.Tensor) -> torch.Tensor:
            j = next(calls)
            if greedy:
                return logits.argmax(-1)
            noise = _gumbel(self.seeds[:n], self.counters[:n] * _STREAMS + j, logits.shape[-1])
            return (logits.float() / self.temperature + noise).argmax(-1)

        return sample

    def step(self, n: int, kv_len: int, greedy: bool, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One round over rows 0..n-1 -> (n, 2k + 3) float64: emitted tokens, their log-probs, accepted m."""
        engine, k, cache = self.engine, self.k, self.engine.cache
        cur, col, pos, live = self.cur[:n], self.col[:n], self.pos[:n], self.live[:n]
        drafted, draft_logits = self.draft.propose(self.draft_state(n), k=k, sample=self._sampler(n, greedy),
                                                   kv_len=kv_len, **inputs)
        vcols, vpos = col[:, None] + self.steps, pos[:, None] + self.steps  # (n, k + 1)
        cache.valid[:n].scatter_(1, vcols, True)  # scatter, not index_put of a Python bool: no host copy (graphs)
        key_cols = torch.arange(kv_len, device=engine.device)
        allowed = (cache.valid[:n, None, :kv_len] & (key_cols[None, None] <= vcols[..., None]))[:, None]
        logits, hidden = target_forward(engine, torch.cat([cur[:, None], drafted], 1), vpos, vcols, decode=True,
                                        kv_len=kv_len, allowed=allowed, layer_ids=self.draft.layer_ids)
        scale = torch.ones_like(self.temperature) if greedy else self.temperature
        if greedy:
            m, nxt = accept_greedy(drafted, logits)
        else:
            p = (logits.float() / scale).softmax(-1)
            q = (draft_logits.float() / scale).softmax(-1)
            seeds, base = self.seeds[:n], self.counters[:n] * _STREAMS
            m, nxt = accept_sampling(drafted, q, p, uniform_noise(seeds, base + _ACCEPT, k),
                                     _gumbel(seeds, base + _RESIDUAL, p.shape[-1]))
        emitted = torch.cat([drafted, torch.zeros_like(cur[:, None])], 1).scatter(1, m[:, None], nxt[:, None])
        log_probs = (logits.float() / scale).log_softmax(-1).gather(-1, emitted[..., None])[..., 0]
        new = {"tokens": emitted, "columns": vcols + 1, "positions": vpos + 1, "features": hidden,
               "valid": torch.ones_like(vcols, dtype=torch.bool)}
        for key, value in new.items():  # rows that finished keep their inputs (no column overflow)
            self.inputs[key][:n].copy_(_where_rows(live, value, self.inputs[key][:n]))
        self.last[:n].copy_(torch.where(live, m, self.last[:n]))
        advance = torch.where(live, m + 1, torch.zeros_like(m))  # rows that finished keep their columns
        col += advance
        pos += advance
        self.counters[:n] += advance
        cur.copy_(torch.where(live, nxt, cur))
        return torch.cat([emitted.double(), log_probs.double(), m[:, None].double()], 1)


@torch.no_grad()
def speculative_generate(engine: Any, batch: Any, params: SamplingParams) -> Any:
    """``engine.generate`` with the attached draft (module docstring); returns the rollout DataProto."""
    if params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0):
        raise ValueError(f"speculative decoding samples the full distribution; top_k={params.top_k}, "
                         f"top_p={params.top_p} are not supported (allowed: top_k <= 0, top_p = 1)")
    requests, prompts, prompt_mask = requests_from_batch(batch, params)
    if any(r.response for r in requests):
        raise ValueError("speculative decoding does not continue interrupted batches")
    stops = stop_ids_for(params, engine.eos_token_ids)
    rounds = getattr(engine, "spec_rounds", None)
    if rounds is None or rounds.draft is not engine.draft or rounds.k != engine.spec_tokens:
        rounds = engine.spec_rounds = _Rounds(engine, engine.draft, engine.spec_tokens)
    start = time.perf_counter()
    stats = {"rounds": 0, "emitted": 0, "prefill_s": 0.0}
    for first in range(0, len(requests), engine.max_batch_size):
        _run_chunk(engine, rounds, requests[first:first + engine.max_batch_size], params, stops, stats)
    if engine.device.type == "cuda":  # this thread's stream (as NativeEngine.generate)
        torch.cuda.current_stream(engine.device).synchronize()
    meta = rollout_meta(requests, params, weight_version=engine.weight_version, tokens=generated_tokens(requests),
                        seconds=time.perf_counter() - start, prefill_seconds=stats["prefill_s"],
                        cuda_graphs=bool(rounds.graphs.graphs) and rounds.graphs.error is None)
    meta["speculative"] = {"tau": stats["emitted"] / max(stats["rounds"], 1), "row_rounds": stats["rounds"],
                           "draft_tokens": engine.spec_tokens, "draft": getattr(engine.draft, "kind", "?")}
    return build_rollout_batch(requests, prompts, prompt_mask, width=params.max_new_tokens, pad_id=engine.pad_token_id,
                               tokenizer=engine.tokenizer, meta_info=meta)


def _emit(request: Any, tokens: list[int], log_probs: list[float], params: SamplingParams, stops: frozenset[int]) -> None:
    for token, log_prob in zip(tokens, log_probs):
        request.response.append(token)
        request.log_probs.append(log_prob)
        if token in stops:
            request.finish_reason = STOP
        elif len(request.response) >= min(params.max_new_tokens, request.max_new_tokens or params.max_new_tokens):
            request.finish_reason = LENGTH  # the sampling's cap, or the row's own (input column max_new_tokens)
        if request.done:
            return


def _run_chunk(engine: Any, rounds: _Rounds, requests: list[Any], params: SamplingParams, stops: frozenset[int],
               stats: dict) -> None:
    k, device = rounds.k, engine.device
    tick = time.perf_counter()
    width = max(len(r.prompt) for r in requests)
    room = params.max_new_tokens + 2 * k + 3  # the rounds' columns past the prompt
    if width + room > engine.max_seq_len:
        raise ValueError(f"speculative decoding needs max_seq_len >= prompt ({width}) + max_new_tokens "
                         f"({params.max_new_tokens}) + 2 * k ({k}) + 3; engine max_seq_len={engine.max_seq_len}")
    greedy = params.temperature <= 0
    n = len(requests)
    rows = torch.arange(n, device=device)
    for name in fields(rounds.state):
        getattr(rounds.state, name.name)[:n].zero_()
    # the engine's prefill (a small one from a CUDA graph, possibly at a wider padded width)
    ids, mask, positions, last, hidden = engine.prefill([r.prompt for r in requests], rows, room=room,
                                                        layer_ids=rounds.draft.layer_ids)
    width = ids.shape[1]
    rounds.seeds[:n].copy_(torch.tensor([r.seed for r in requests]))
    rounds.counters[:n].zero_()
    rounds.temperature.fill_(1.0 if greedy else params.temperature)
    last = last.float() / rounds.temperature
    cur = last.argmax(-1) if greedy else (last + _gumbel(rounds.seeds[:n], rounds.counters[:n] + _RESIDUAL,
                                                         last.shape[-1])).argmax(-1)
    lp = last.log_softmax(-1).gather(-1, cur[:, None])[:, 0].tolist()
    for r, token, log_prob in zip(requests, cur.tolist(), lp):
        _emit(r, [token], [log_prob], params, stops)
    rounds.cur[:n].copy_(cur)
    rounds.counters[:n].fill_(1)
    rounds.col[:n].fill_(width)
    rounds.pos[:n].copy_(positions[:, -1] + 1)
    context = {"tokens": torch.cat([ids[:, 1:], cur[:, None]], 1), "features": hidden,
               "columns": torch.arange(1, width + 1, device=device).expand(n, width),
               "positions": torch.cat([positions[:, 1:], positions[:, -1:] + 1], 1), "valid": mask.bool()}
    rounds.load_context(n, context)
    stats["prefill_s"] += time.perf_counter() - tick  # the prompt's forward, first token and context commit
    columns = [width] * n  # host mirror of rounds.col (a row advances by its accepted count + 1)
    live = [not r.done for r in requests]
    rounds.set_live(live)

    def kv_len_for(longest: int) -> int:  # a round's draft columns reach col + 2k + 2
        return min(engine.max_seq_len, -(-(longest + 2 * k + 3) // engine.kv_block) * engine.kv_block)

    queued = rounds.launch(n, kv_len_for(max(columns)), greedy) if any(live) else None
    while queued is not None:
        # run-ahead: round r + 1 before reading round r, at the kv_len of the longest possible advance (k + 1);
        # only with room for it: a row that finished in round r advances once more (its device column is then
        # at most its host column + k + 1, and a frozen row's rounds write up to that + 2k + 2)
        longest = max(columns) + k + 1
        ahead = rounds.launch(n, kv_len_for(longest), greedy) if longest + 3 * k + 4 <= engine.max_seq_len else None
        view, event = queued
        if event is not None:
            event.synchronize()
        host = view.tolist()  # the round's one host sync
        for i, (r, row) in enumerate(zip(requests, host)):
            if not live[i]:
                continue
            count = int(row[2 * k + 2]) + 1
            stats["rounds"] += 1
            stats["emitted"] += count
            columns[i] += count
            _emit(r, [int(t) for t in row[:count]], row[k + 1:k + 1 + count], params, stops)
        now = [not r.done for r in requests]
        if not any(now):
            break  # a queued run-ahead round only touched finished rows: its results are dropped
        if now != live:
            live = now
            rounds.set_live(live)  # frozen from the next queued round on (the run-ahead one had them live)
        if ahead is None:
            ahead = rounds.launch(n, kv_len_for(max(columns)), greedy)
        queued = ahead
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the dropped run-ahead round, before the slots are reset
    engine.cache.clear_slots(rows)


def _where_rows(keep_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    shape = (-1,) + (1,) * (new.dim() - 1)
    return torch.where(keep_new.view(shape), new, old)
