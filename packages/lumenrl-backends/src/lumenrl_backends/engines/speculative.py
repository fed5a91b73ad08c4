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
  ``softmax(logits / T)`` (tested with a chi-square bound). Randomness: one ``torch.Generator``
  per ``generate`` call seeded from the first row's seed, so outputs are reproducible, but not the
  same draws as the plain engine's counter-based sampler. top-k / top-p are refused.

Log-probs are the target's ``log_softmax(logits / T)`` at each emitted token (temperature 1 for
greedy), the contracts' convention, from the verify forward. ``tau`` = tokens emitted per verify
forward (accepted + 1), averaged over live rows and rounds, goes to ``meta_info["speculative"]``.

Hidden-state capture (engine capability ``hidden_state_capture``): :func:`capture_hidden` runs the
engine's model over a batch through its cache and attention (prefill view) and returns the
lumenrl-sddd capture dict (chosen layers + logits), what the SDDD trainer's teacher sends.

Limits (documented in docs/decisions/0013-sddd.md): no CUDA graphs for the draft and verify steps
yet (eager forwards; one host sync per round for the acceptance bookkeeping); batches run in
lockstep rounds (no continuous batching: rows that finish are frozen until the batch ends); no
sliding-window models; no interrupt/resume mid-batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lumenrl_backends.engines.attention import engine_attention
from lumenrl_backends.engines.kv_cache import CacheView, prefill_mask, to_attention_mask
from lumenrl_backends.engines.requests import (
    LENGTH,
    STOP,
    build_rollout_batch,
    generated_tokens,
    left_pad,
    requests_from_batch,
    rollout_meta,
    stop_ids_for,
)
from lumenrl_backends.engines.sampling import SamplingParams
from lumenrl_sddd.capture import select_hidden

__all__ = ["attach_draft", "attach_from_config", "speculative_generate", "capture_hidden", "accept_greedy", "accept_sampling",
           "target_forward"]


def attach_draft(engine: Any, draft: Any, num_tokens: int) -> None:
    """Make ``engine.generate`` decode speculatively with ``draft`` (None detaches)."""
    if draft is not None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if engine.window is not None:
            raise ValueError("speculative decoding does not support sliding-window attention models")
        if getattr(engine, "exact", False):
            raise ValueError("speculative decoding cannot give exact_logprobs (its verify forward is not the "
                             "trainer's batch-invariant path); allowed: policy.rollout.exact_logprobs=false")
        dtype = next(engine.model.parameters()).dtype
        draft = draft.to(engine.device, dtype).eval()
    engine.draft, engine.spec_tokens = draft, num_tokens


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
    attach_draft(engine, draft, k)


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


def accept_sampling(drafted: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafted (b, k), draft probs q (b, k, V), target probs p (b, k + 1, V) -> (m (b,), next token (b,))."""
    b, k = drafted.shape
    pd = p[:, :k].gather(2, drafted[..., None])[..., 0]
    qd = q.gather(2, drafted[..., None])[..., 0]
    u = torch.rand(b, k, generator=generator, device=p.device)
    m = (u * qd < pd).long().cumprod(1).sum(1)  # accept with probability min(1, p / q)
    rows = torch.arange(b, device=p.device)
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # all accepted: q = 0, residual = p_k
    residual = (p[rows, m] - q_pad[rows, m]).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q exactly: no residual mass, p itself
    residual = torch.where(empty, p[rows, m], residual)
    return m, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def _sampler(temperature: float, generator: torch.Generator):
    def sample(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        return torch.multinomial((logits.float() / temperature).softmax(-1), 1, generator=generator)[:, 0]

    return sample


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
    start = time.perf_counter()
    stats = {"rounds": 0, "emitted": 0}
    for first in range(0, len(requests), engine.max_batch_size):
        _run_chunk(engine, requests[first:first + engine.max_batch_size], params, stops, stats)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    meta = rollout_meta(requests, params, weight_version=engine.weight_version, tokens=generated_tokens(requests),
                        seconds=time.perf_counter() - start, cuda_graphs=False)
    meta["speculative"] = {"tau": stats["emitted"] / max(stats["rounds"], 1), "row_rounds": stats["rounds"],
                           "draft_tokens": engine.spec_tokens, "draft": getattr(engine.draft, "kind", "?")}
    return build_rollout_batch(requests, prompts, prompt_mask, width=params.max_new_tokens, pad_id=engine.pad_token_id,
                               tokenizer=engine.tokenizer, meta_info=meta)


def _log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    scale = temperature if temperature > 0 else 1.0
    return (logits.float() / scale).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


def _emit(request: Any, tokens: list[int], log_probs: list[float], params: SamplingParams, stops: frozenset[int]) -> None:
    for token, log_prob in zip(tokens, log_probs):
        request.response.append(token)
        request.log_probs.append(log_prob)
        if token in stops:
            request.finish_reason = STOP
        elif len(request.response) >= params.max_new_tokens:
            request.finish_reason = LENGTH
        if request.done:
            return


def _run_chunk(engine: Any, requests: list[Any], params: SamplingParams, stops: frozenset[int], stats: dict) -> None:
    draft, k, device = engine.draft, engine.spec_tokens, engine.device
    ids, mask = left_pad([r.prompt for r in requests], engine.pad_token_id, device)
    n, width = ids.shape
    if width + params.max_new_tokens + 2 * k + 2 > engine.max_seq_len:
        raise ValueError(f"speculative decoding needs max_seq_len >= prompt ({width}) + max_new_tokens "
                         f"({params.max_new_tokens}) + 2 * k ({k}) + 2; engine max_seq_len={engine.max_seq_len}")
    generator = torch.Generator(device=device)
    generator.manual_seed(requests[0].seed)
    sample = _sampler(params.temperature, generator)
    rows = torch.arange(n, device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    engine.cache.clear_slots(rows)
    engine.cache.valid[rows, :width] = mask.bool()
    logits, hidden = target_forward(engine, ids, positions, torch.arange(width, device=device).expand(n, width),
                                    decode=False, kv_len=width, allowed=prefill_mask(mask), layer_ids=draft.layer_ids,
                                    last_only=True)
    cur = sample(logits[:, -1])
    lp = _log_probs(logits[:, -1], cur, params.temperature).tolist()
    for r, token, log_prob in zip(requests, cur.tolist(), lp):
        _emit(r, [token], [log_prob], params, stops)
    state = draft.start(n, engine.max_seq_len, device)
    inputs = {"tokens": torch.cat([ids[:, 1:], cur[:, None]], 1), "features": hidden,
              "columns": torch.arange(1, width + 1, device=device).expand(n, width).contiguous(),
              "positions": torch.cat([positions[:, 1:], positions[:, -1:] + 1], 1), "valid": mask.bool(),
              "last": torch.full((n,), width - 1, dtype=torch.long, device=device)}
    col = torch.full((n,), width, dtype=torch.long, device=device)
    pos = positions[:, -1] + 1
    steps = torch.arange(k + 1, device=device)
    while not all(r.done for r in requests):
        live = torch.tensor([not r.done for r in requests], device=device)
        drafted, draft_logits = draft.propose(state, k=k, sample=sample, **inputs)
        vcols, vpos = col[:, None] + steps, pos[:, None] + steps  # (n, k + 1)
        engine.cache.valid[rows[:, None], vcols] = True
        kv_len = min(engine.max_seq_len, -(-(int(vcols.max()) + 1) // engine.kv_block) * engine.kv_block)
        key_cols = torch.arange(kv_len, device=device)
        allowed = (engine.cache.valid[:n, None, :kv_len] & (key_cols[None, None] <= vcols[..., None]))[:, None]
        logits, hidden = target_forward(engine, torch.cat([cur[:, None], drafted], 1), vpos, vcols, decode=True,
                                        kv_len=kv_len, allowed=allowed, layer_ids=draft.layer_ids)
        if params.temperature > 0:
            p = (logits.float() / params.temperature).softmax(-1)
            q = (draft_logits.float() / params.temperature).softmax(-1)
            m, nxt = accept_sampling(drafted, q, p, generator)
        else:
            m, nxt = accept_greedy(drafted, logits)
        emitted = torch.cat([drafted, torch.zeros_like(cur[:, None])], 1).scatter(1, m[:, None], nxt[:, None])
        lps = _log_probs(logits, emitted, params.temperature)
        stats["rounds"] += int(live.sum())
        stats["emitted"] += int(((m + 1) * live).sum())
        for i, (r, count) in enumerate(zip(requests, (m + 1).tolist())):
            if not r.done:
                _emit(r, emitted[i, :count].tolist(), lps[i, :count].tolist(), params, stops)
        go = live  # rows that finished before this round keep their inputs (no column overflow)
        advance = torch.where(go, m + 1, torch.zeros_like(m))
        new = {"tokens": emitted, "features": hidden, "columns": vcols + 1, "positions": vpos + 1,
               "valid": torch.ones_like(vcols, dtype=torch.bool), "last": m}
        if inputs["tokens"].shape[1] == k + 1:
            new = {key: _where_rows(go, value, inputs[key]) for key, value in new.items()}
        inputs = new
        col, pos = col + advance, pos + advance
        cur = torch.where(go, nxt, cur)
    engine.cache.clear_slots(rows)


def _where_rows(keep_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    shape = (-1,) + (1,) * (new.dim() - 1)
    return torch.where(keep_new.view(shape), new, old)
