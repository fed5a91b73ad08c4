"""Fused Gumbel-max sampling in Triton: one read of the logits, parallel over rows and vocab chunks.

Computes what :func:`lumenrl_backends.engines.sampling.sample_tokens` computes without top-k/top-p
(``greedy`` and ``plain`` modes), in two small kernels instead of ~15 full-vocabulary torch ops
(the counter-based noise alone is ~10 int64 passes over ``(B, V)``):

* ``scaled = logits / t`` (t = 1 for greedy rows), streamed in ``BLOCK_V`` blocks;
* the row's log-normaliser ``logsumexp(scaled)`` by an online max / sum;
* ``argmax(scaled + g)`` with ``g = -log(-log(u))``, ``u`` the same counter-based hash of (seed,
  counter, vocab id) as the torch path (murmur3 finaliser in uint32 arithmetic; the per-row key
  of :func:`row_keys` is computed in-kernel from the int64 seed and counter by the chunked kernel,
  by ~40 tiny torch ops before the launch by the rowwise one), and ``argmax(scaled)`` for greedy rows;
* output: the token and ``scaled[token] - logsumexp``.

``impl="chunked"`` (default) splits the work in two launches:

1. ``_chunk_kernel``, grid ``(B, n_chunks)``: each program reads ``CHUNK`` columns of one row and
   writes, per (row, chunk), the max of ``scaled`` and ``sum(exp(scaled - max))`` (the partial
   logsumexp), the index of that max (greedy) and the max of ``scaled + g`` with its index
   (sampled) into float32 / int32 scratch ``(B, n_chunks)`` buffers. Within a chunk, blocks are
   merged with a strict ``>`` so the earliest block wins a tie.
2. ``_combine_kernel``, grid ``(B,)``: ``lse = M + log(sum_c s_c exp(m_c - M))``, the argmax over
   chunks with ties to the LOWEST chunk (so, overall, to the lowest vocab id, as ``torch.argmax``),
   then ``scaled[token]`` is re-read from the logits (one element; bit-identical to stage 1's
   value) and ``token`` (int64) / ``scaled[token] - lse`` (float32) are written.

With B = 64 and V = 151936 this is ~1200 programs instead of 64 walking 37 blocks each, so the
read of the logits can run at memory bandwidth. ``chunk=None`` picks the largest power of two in
[1024, 8192] that still gives ``>= _TARGET_PROGRAMS`` programs (smaller chunks for small batches).
Everything is allocated with ``torch.empty`` from shapes only: no host sync, CUDA-graph safe.

``impl="rowwise"`` keeps the previous one-program-per-row kernel (for benchmarks and as a check).

The draws are the torch path's up to float rounding of ``log`` in the Gumbel transform (a token
can differ only at a near-exact tie); the log-normaliser differs from torch's by float rounding.
"""

from __future__ import annotations

import torch

__all__ = ["available", "fused_sample", "fused_sampler_agrees", "default_chunk"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None

IMPLS = ("chunked", "rowwise")
_TARGET_PROGRAMS = 1024  # ~8 per SM of a 132-SM H100/H200: enough to keep the reads in flight
_CHUNK_RANGE = (1024, 8192)  # auto chunk bounds (powers of two)
_BLOCK_V_RANGE = (16, 16384)
_MAX_CHUNK = 1 << 20


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
    def _row_key(SEEDS, COUNTERS, row):
        """The torch sampler's per-row key (see :func:`row_keys`) from int64 seed and counter, in uint32."""
        seed = tl.load(SEEDS + row)
        key = _fmix32(seed.to(tl.uint32) ^ _fmix32((seed >> 32).to(tl.uint32)))
        return _fmix32(key ^ (tl.load(COUNTERS + row).to(tl.uint32) * 0x9E3779B1))

    @triton.jit
    def _gumbel_scores(x, cols, ok, key):
        """scaled + g, -inf outside the vocabulary; g from the counter-based hash of (key, col)."""
        h = _fmix32(key ^ (cols.to(tl.uint32) * 0x27D4EB2F))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))

    @triton.jit
    def _chunk_kernel(
        LOGITS, TEMP, SEEDS, COUNTERS, PART_MAX, PART_SUM, PART_IDX, PART_C, PART_C_IDX, vocab, s_lb, n_chunks,
        GREEDY_ONLY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        temp = tl.load(TEMP + row)
        inv_t = 1.0 / tl.where(temp <= 0.0, 1.0, temp)
        key = _row_key(SEEDS, COUNTERS, row)
        LOGITS += row.to(tl.int64) * s_lb  # int64: rows * s_lb may pass 2**31 (large B * V, strided views)
        offs = tl.arange(0, BLOCK_V)
        start = chunk * (BLOCK_V * BLOCKS_PER_CHUNK)
        run_max = tl.full([1], float("-inf"), tl.float32)  # also the greedy best value
        run_sum = tl.zeros([1], tl.float32)
        best_idx = tl.zeros([1], tl.int32) + start
        best_c = tl.full([1], float("-inf"), tl.float32)  # sampled: max scaled + gumbel
        best_c_idx = tl.zeros([1], tl.int32) + start
        for block in range(0, BLOCKS_PER_CHUNK):
            cols = start + block * BLOCK_V + offs
            ok = cols < vocab
            x = tl.load(LOGITS + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            blk_max, i_s = tl.max(x, 0, return_indices=True)  # ties -> lowest index
            new_max = tl.maximum(run_max, blk_max)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf prefix sums to 0, not nan
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), 0)
            best_idx = tl.where(blk_max > run_max, start + block * BLOCK_V + i_s, best_idx)
            run_max = new_max
            if not GREEDY_ONLY:
                blk_c, i_c = tl.max(_gumbel_scores(x, cols, ok, key), 0, return_indices=True)
                best_c_idx = tl.where(blk_c > best_c, start + block * BLOCK_V + i_c, best_c_idx)
                best_c = tl.maximum(best_c, blk_c)
        at = row * n_chunks + chunk + tl.arange(0, 1)
        tl.store(PART_MAX + at, run_max)
        tl.store(PART_SUM + at, run_sum)
        tl.store(PART_IDX + at, best_idx)
        if not GREEDY_ONLY:
            tl.store(PART_C + at, best_c)
            tl.store(PART_C_IDX + at, best_c_idx)

    @triton.jit
    def _combine_kernel(
        LOGITS, TEMP, PART_MAX, PART_SUM, PART_IDX, PART_C, PART_C_IDX, TOKENS, LOGPROBS, s_lb, n_chunks,
        GREEDY_ONLY: tl.constexpr, CHUNKS_P2: tl.constexpr,
    ):
        row = tl.program_id(0)
        temp = tl.load(TEMP + row)
        greedy = temp <= 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, temp)
        ch = tl.arange(0, CHUNKS_P2)
        ok = ch < n_chunks
        base = row * n_chunks
        m = tl.load(PART_MAX + base + ch, mask=ok, other=float("-inf"))
        s = tl.load(PART_SUM + base + ch, mask=ok, other=0.0)
        top, i_m = tl.max(m, 0, return_indices=True)  # ties -> lowest chunk -> lowest vocab id
        shift = tl.where(top == float("-inf"), 0.0, top)
        lse = top + tl.log(tl.sum(s * tl.exp(m - shift), 0))
        token = tl.load(PART_IDX + base + i_m)
        if not GREEDY_ONLY:
            c = tl.load(PART_C + base + ch, mask=ok, other=float("-inf"))
            _, i_c = tl.max(c, 0, return_indices=True)
            token = tl.where(greedy, token, tl.load(PART_C_IDX + base + i_c))
        value = tl.load(LOGITS + row.to(tl.int64) * s_lb + token).to(tl.float32) * inv_t  # == stage 1's scaled[token]
        tl.store(TOKENS + row, token.to(tl.int64))
        tl.store(LOGPROBS + row, value - lse)

    @triton.jit
    def _sample_kernel(
        LOGITS, TEMP, KEYS, TOKENS, LOGPROBS, vocab, s_lb,
        GREEDY_ONLY: tl.constexpr, BLOCK_V: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    ):
        """impl="rowwise": one program per row walks the whole vocabulary."""
        row = tl.program_id(0)
        temp = tl.load(TEMP + row)
        greedy = temp <= 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, temp)
        key = tl.load(KEYS + row).to(tl.uint32, bitcast=True)
        LOGITS += row.to(tl.int64) * s_lb
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
            x = tl.load(LOGITS + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            blk_max = tl.max(x, 0)
            new_max = tl.maximum(run_max, blk_max)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf prefix sums to 0, not nan
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), 0)
            run_max = new_max
            i_s = tl.argmax(x, 0)
            take_s = blk_max > best_s
            best_s_idx = tl.where(take_s, block * BLOCK_V + i_s, best_s_idx)
            best_s = tl.where(take_s, blk_max, best_s)
            if not GREEDY_ONLY:
                c = _gumbel_scores(x, cols, ok, key)
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_chunk(batch: int, vocab: int, block_v: int = _CHUNK_RANGE[0]) -> int:
    """Largest power-of-two chunk in [1024, 8192] (and >= block_v) giving >= _TARGET_PROGRAMS programs."""
    chunk = max(_CHUNK_RANGE[1], block_v)
    while chunk > max(_CHUNK_RANGE[0], block_v) and batch * _cdiv(vocab, chunk) < _TARGET_PROGRAMS:
        chunk //= 2
    return chunk


def _check_power_of_two(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high or value & (value - 1):
        raise ValueError(f"{name}={value!r}: must be a power of two in [{low}, {high}]")
    return value


def _launch_params(impl: str, batch: int, vocab: int, block_v: int | None, chunk: int | None) -> tuple[int, int]:
    """Validated (block_v, chunk); chunk is 0 for impl="rowwise"."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {', '.join(map(repr, IMPLS))}")
    if impl == "rowwise":
        if chunk is not None:
            raise ValueError(f"chunk={chunk!r}: only impl='chunked' takes a chunk (impl='rowwise' walks whole rows)")
        return _check_power_of_two("block_v", 4096 if block_v is None else block_v, *_BLOCK_V_RANGE), 0
    if block_v is not None:
        _check_power_of_two("block_v", block_v, *_BLOCK_V_RANGE)
    if chunk is None:
        chunk = default_chunk(batch, vocab, block_v or _CHUNK_RANGE[0])
    _check_power_of_two("chunk", chunk, _BLOCK_V_RANGE[0], _MAX_CHUNK)
    block_v = min(chunk, 2048) if block_v is None else block_v
    if block_v > chunk:
        raise ValueError(f"block_v={block_v}: must be <= chunk={chunk} (a chunk is a whole number of blocks)")
    return block_v, chunk


def fused_sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    greedy_only: bool = False,
    block_v: int | None = None,
    chunk: int | None = None,
    impl: str = "chunked",
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> tokens (B,) int64, float32 log-probs (B,); per-row temperature/seed/counter (B,).

    ``chunk`` (columns per program, power of two, default :func:`default_chunk`) and ``block_v``
    (columns per step inside a program, power of two <= chunk; default min(chunk, 2048), 4096 for
    ``impl="rowwise"``) are launch parameters: they change the speed, never the tokens."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V); got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    for name, value in (("temperature", temperature), ("seeds", seeds), ("counters", counters)):
        if tuple(value.shape) != (batch,):  # the kernels read one value per row: a short tensor reads out of bounds
            raise ValueError(f"{name} must have shape (B,) = ({batch},) for logits {tuple(logits.shape)}; "
                             f"got {tuple(value.shape)}")
    block_v, chunk = _launch_params(impl, batch, vocab, block_v, chunk)
    _check_power_of_two("num_warps", num_warps, 1, 16)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if impl == "rowwise":  # as before: the keys by ~40 tiny torch ops, then one program per row
        keys = row_keys(seeds, counters)
        keys = torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)  # same 32 bits, signed; bitcast in-kernel
        _sample_kernel[(batch,)](
            logits, temperature, keys, tokens, log_probs, vocab, logits.stride(0),
            GREEDY_ONLY=greedy_only, BLOCK_V=block_v, NUM_BLOCKS=_cdiv(vocab, block_v), num_warps=num_warps,
        )
        return tokens, log_probs
    n_chunks = _cdiv(vocab, chunk)
    part_f = torch.empty((3, batch, n_chunks), dtype=torch.float32, device=logits.device)  # max, sum-exp, best c
    part_i = torch.empty((2, batch, n_chunks), dtype=torch.int32, device=logits.device)  # argmax, argmax c
    parts = (part_f[0], part_f[1], part_i[0], part_f[2], part_i[1])
    _chunk_kernel[(batch, n_chunks)](
        logits, temperature, seeds.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous(), *parts, vocab, logits.stride(0), n_chunks,
        GREEDY_ONLY=greedy_only, BLOCK_V=block_v, BLOCKS_PER_CHUNK=chunk // block_v, num_warps=num_warps,
    )
    _combine_kernel[(batch,)](
        logits, temperature, *parts, tokens, log_probs, logits.stride(0), n_chunks,
        GREEDY_ONLY=greedy_only, CHUNKS_P2=max(16, triton.next_power_of_2(n_chunks)), num_warps=1,
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
