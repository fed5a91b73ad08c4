"""Sampling parameters and a batched, seeded, graph-friendly sampler.

Processing order (per row, all rows in one batched call):

1. ``scaled = logits.float() / temperature`` (temperature 0 means greedy; its log-probs use
   temperature 1). The log-prob of the chosen token is ``log_softmax(scaled)[token]`` over the
   FULL vocabulary, the convention of docs/decisions/0001-contracts.md, so engine and trainer
   numbers are comparable. Top-k/top-p only restrict which tokens may be drawn.
2. top-k keeps the k largest ``scaled`` values (k <= 0 disables); top-p then keeps the smallest
   prefix of the top-k-renormalised distribution, sorted descending, whose mass reaches p (the
   first token always survives). This is the HF / vLLM order.
3. Sampling is Gumbel-max: ``argmax(masked + g)`` with ``g = -log(-log(u))`` is an exact draw
   from ``softmax(masked)``. ``u`` comes from a counter-based hash of (request seed, response
   token index, vocab id) instead of a stateful ``torch.Generator``: a request's draws depend only
   on its own seed and position, never on which other requests share the batch or slot, an
   interrupted sequence resumes with exactly the noise it would have used, and the step has no
   host-side RNG state (so it can be captured in a CUDA graph). ``u`` has 24 random bits, so
   ``g`` is capped near 17.3; the induced bias is below 1e-7 per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["SamplingParams", "coerce_sampling", "uniform_noise", "restrict_support", "sample_tokens"]

_MASK32 = 0xFFFFFFFF


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 disables
    top_k: int = -1  # <= 0 disables
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to EOS
    ignore_eos: bool = False  # never stop at EOS (stop_token_ids still stop)
    seed: int | None = None  # row i uses seed + i unless the batch carries a "seed" column

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


def coerce_sampling(sampling: Any) -> SamplingParams:
    """Accept a SamplingParams, a mapping or any object with the same attribute names (e.g. the
    run config's ``SamplingConfig``); unknown keys of a mapping are ignored (``n``, ...)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    names = [f.name for f in fields(SamplingParams)]
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, Mapping):
        values = {k: sampling[k] for k in names if k in sampling}
    else:
        values = {k: getattr(sampling, k) for k in names if hasattr(sampling, k)}
    if "stop_token_ids" in values:
        values["stop_token_ids"] = [int(t) for t in values["stop_token_ids"] or []]
    return SamplingParams(**values)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) int64 seeds and counters -> (B, V) float32 uniforms in (0, 1), 24 random bits each."""
    seeds = seeds.to(torch.int64)
    row = _fmix32((seeds & _MASK32) ^ _fmix32((seeds >> 32) & _MASK32))  # (B,)
    row = _fmix32(row ^ ((counters.to(torch.int64) * 0x9E3779B1) & _MASK32))  # (B,)
    vocab = (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F) & _MASK32
    h = _fmix32(row[:, None] ^ vocab[None, :])  # (B, V)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def restrict_support(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. scaled (B, V); top_k, top_p (B,)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    return scaled.masked_fill(mask, float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    restrict: bool = True,
    greedy_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits (B, V); per-row params (B,). Returns tokens (B,) int64 and
    their float32 log-probs (B,) under ``log_softmax(logits / temperature)``.

    ``restrict=False`` skips the top-k/top-p sort when no row uses them; ``greedy_only=True``
    (every row has temperature 0) skips the noise, which is then unused.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = logits.float() / temp[:, None]  # (B, V)
    log_norm = torch.logsumexp(scaled, dim=-1)  # (B,): log_softmax without a (B, V) output
    if greedy_only:
        tokens = scaled.argmax(dim=-1)
    else:
        candidates = restrict_support(scaled, top_k, top_p) if restrict else scaled
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, scaled.shape[-1])))
        drawn = (candidates + gumbel).argmax(dim=-1)
        tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn)
    return tokens, scaled.gather(1, tokens[:, None]).squeeze(1) - log_norm
