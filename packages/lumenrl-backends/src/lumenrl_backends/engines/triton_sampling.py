"""Fused Gumbel-max sampling in Triton: one pass over the logits per row.

Computes what :func:`lumenrl_backends.engines.sampling.sample_tokens` computes without top-k/top-p
(``greedy`` and ``plain`` modes), in one kernel instead of ~15 full-vocabulary torch ops (the
counter-based noise alone is ~10 int64 passes over ``(B, V)``):

* ``scaled = logits / t`` (t = 1 for greedy rows), streamed in ``BLOCK_V`` chunks;
* the row's log-normaliser ``logsumexp(scaled)`` by an online max / sum;
* ``argmax(scaled + g)`` with ``g = -log(-log(u))``, ``u`` the same counter-based hash of (seed,
  counter, vocab id) as the torch path (murmur3 finaliser in uint32 arithmetic; the per-row key
  is computed by the torch code and passed in), and ``argmax(scaled)`` for greedy rows;
* output: the token and ``scaled[token] - logsumexp``.

The draws are the torch path's up to float rounding of ``log`` in the Gumbel transform (a token
can differ only at a near-exact tie). Ties resolve to the lowest vocab id, as ``torch.argmax``.
"""

from __future__ import annotations

import torch

__all__ = ["available", "fused_sample", "fused_sampler_agrees"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _fmix32(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _sample_kernel(
        LOGITS, TEMP, KEYS, TOKENS, LOGPROBS, vocab, s_lb,
        GREEDY_ONLY: tl.constexpr, BLOCK_V: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        temp = tl.load(TEMP + row)
        greedy = temp <= 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, temp)
        key = tl.load(KEYS + row).to(tl.uint32, bitcast=True)
        offs = tl.arange(0, BLOCK_V)
        run_max = tl.full([1], float("-inf"), tl.float32)
        run_sum = tl.zeros([1], tl.float32)
        best_s = tl.full([1], float("-inf"), tl.float32)  # greedy: max scaled
        best_s_idx = tl.zeros([1], tl.int32)
        best_c = tl.full([1], float("-inf"), tl.float32)  # sampled: max scaled + gumbel
        best_c_idx = tl.zeros([1], tl.int32)
        best_c_val = tl.zeros([1], tl.float32)  # scaled value at the sampled token
        for block in range(0, NUM_BLOCKS):
            cols = block * BLOCK_V + offs
            ok = cols < vocab
            x = tl.load(LOGITS + row * s_lb + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            blk_max = tl.max(x, 0)
            new_max = tl.maximum(run_max, blk_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            run_max = new_max
            i_s = tl.argmax(x, 0)
            take_s = blk_max > best_s
            best_s_idx = tl.where(take_s, block * BLOCK_V + i_s, best_s_idx)
            best_s = tl.where(take_s, blk_max, best_s)
            if not GREEDY_ONLY:
                h = _fmix32(key ^ (cols.to(tl.uint32) * 0x27D4EB2F))
                u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                c = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
                blk_c = tl.max(c, 0)
                i_c = tl.argmax(c, 0)
                take_c = blk_c > best_c
                x_at = tl.sum(tl.where(offs == i_c, x, 0.0), 0)
                best_c_idx = tl.where(take_c, block * BLOCK_V + i_c, best_c_idx)
                best_c_val = tl.where(take_c, x_at, best_c_val)
                best_c = tl.where(take_c, blk_c, best_c)
        lse = run_max + tl.log(run_sum)
        if GREEDY_ONLY:
            token, value = best_s_idx, best_s
        else:
            token = tl.where(greedy, best_s_idx, best_c_idx)
            value = tl.where(greedy, best_s, best_c_val)
        one = tl.arange(0, 1)
        tl.store(TOKENS + row + one, token.to(tl.int64))
        tl.store(LOGPROBS + row + one, value - lse)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The per-row hash key of the torch sampler (uint32 values in int64), (B,)."""
    from lumenrl_backends.engines.sampling import _MASK32, _fmix32

    seeds = seeds.to(torch.int64)
    row = _fmix32((seeds & _MASK32) ^ _fmix32((seeds >> 32) & _MASK32))
    return _fmix32(row ^ ((counters.to(torch.int64) * 0x9E3779B1) & _MASK32))


def fused_sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    greedy_only: bool = False,
    block_v: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> tokens (B,) int64, float32 log-probs (B,); per-row temperature/seed/counter (B,)."""
    batch, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    keys = row_keys(seeds, counters)
    keys = torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)  # same 32 bits, signed; bitcast in-kernel
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sample_kernel[(batch,)](
        logits, temperature.to(torch.float32).contiguous(), keys, tokens, log_probs, vocab, logits.stride(0),
        GREEDY_ONLY=greedy_only, BLOCK_V=block_v, NUM_BLOCKS=triton.cdiv(vocab, block_v),
    )
    return tokens, log_probs


def fused_sampler_agrees(device: torch.device) -> bool:
    """Run the kernel once on fresh random logits and compare with the torch sampler (tokens equal,
    log-probs within 1e-4); any error or mismatch -> False with a warning (the engine keeps torch)."""
    import warnings

    from lumenrl_backends.engines.sampling import sample_tokens

    if not available():
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(1234)
        logits = torch.randn((4, 3001), generator=gen, device=device) * 4
        temperature = torch.tensor([0.0, 1.0, 0.7, 1.3], device=device)
        seeds = torch.tensor([3, 2**40 + 1, 77, 2**61], device=device)
        counters = torch.tensor([0, 7, 300, 12], device=device)
        tokens, log_probs = fused_sample(logits, temperature=temperature, seeds=seeds, counters=counters, block_v=1024)
        ref_tokens, ref_log_probs = sample_tokens(
            logits, temperature=temperature, top_k=torch.zeros_like(seeds), top_p=torch.ones_like(temperature),
            seeds=seeds, counters=counters, restrict=False,
        )
        agrees = torch.equal(tokens, ref_tokens) and bool((log_probs - ref_log_probs).abs().max() < 1e-4)
    except Exception as err:  # noqa: BLE001 - the torch sampler is the fallback
        warnings.warn(f"native engine: fused Triton sampler unavailable ({type(err).__name__}: {err})", stacklevel=2)
        return False
    if not agrees:
        warnings.warn("native engine: fused Triton sampler disagrees with the torch sampler; using torch", stacklevel=2)
    return agrees
