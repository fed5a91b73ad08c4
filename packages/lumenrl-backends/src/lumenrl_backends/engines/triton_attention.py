"""Split-KV grouped-query decode attention in Triton (flash-decoding), for the native engine on CUDA.

Problem: one query token per sequence, ``n_rep = H / H_kv`` query heads per KV head, a slot
cache view ``(B, H_kv, L, D)`` (strided: a prefix of the preallocated cache) and a per-row
"may attend" map ``(B, L)``. Decode attention is bandwidth-bound: the floor is one read of K and
V. SDPA kernels tile queries by 64-128 rows, so with ``n_rep`` = 4 rows per KV head they run far
from that floor (measured on an H200, Qwen3-8B shape, batch 64: cuDNN ~3x the K/V read time).

Kernel: program ``(b, h_kv, split)`` loads the ``n_rep`` query rows of its group once (padded
to 16 rows for ``tl.dot``), walks its chunk of columns in ``BLOCK_N`` blocks with an online
softmax (fp32 max / sum / accumulator), and writes a normalised partial output and its
log-sum-exp. A second kernel merges the splits per ``(b, h_kv)``: ``out = sum_s exp(lse_s - lse)
out_s`` with ``lse = logsumexp_s lse_s``. Splits are chosen so that ``B * H_kv * splits`` covers
the multiprocessors about twice. Masked-out columns get ``-inf`` scores; a row whose columns are
all masked in a split contributes nothing (``lse = -inf``). The engine always leaves the written
column visible, so every row has at least one key.

Multi-query decode (speculative decoding's verify forward: Q = k + 1 query tokens per row at
consecutive cache columns): the G query heads x Q queries of one KV head are G * Q packed rows of the
same program (the (B, H, Q, D) query viewed as (B, H_kv, G * Q, D), no copy), so K/V are still read
once per KV head (no ``repeat_kv``); each packed row takes its own query's mask row, ``allowed``
(B, Q, L) (the engine: the row's valid columns up to that query's own column), loaded per tile as a
(rows, BLOCK_N) tile instead of one shared (BLOCK_N,) vector. Up to :data:`MAX_ROWS` packed rows.

Bounded walk: the engine passes each row's write column (``last``; the mask never allows a later
column), and a program's loop ends there, so columns past a row's length are neither loaded nor
computed. This matters under ``compile="full"``, where the attended length is fixed at
``max_seq_len``: rows at their mean length no longer pay for the whole cache.

An FP8 cache is read as stored: one-element K/V dequant scales are folded into the scores and
the output, so no dequantized copy of the cache is made. With a 16-bit query its dots run in fp16
(query cast once; a float32 query keeps float32):
E4M3/E5M2 -> fp16 is a single conversion on sm_89+/sm_90 while -> bf16 goes through float32,
which left the FP8 kernel conversion-bound (1.7 TB/s, barely faster than bf16's 3.2 TB/s at half the
bytes; ``bench_attention.py``). fp16 holds every E4M3/E5M2 value exactly and has the finer mantissa.

V may also be stored transposed, ``(D, L)`` per head (a view with ``stride(-2) == 1``), read as is.
Tried for the FP8 cache (the p.v dot reduces over L, and ``ldmatrix.trans`` cannot transpose 8-bit
tiles): on the H200 the strided column loads cost far more than they save (FP8 80 us vs 27 us per
call at the 8B shape, ``bench_attention.py --tune --space layouts``), so the engine does not use it.
What does pay in the kernel: V in (D, T) tiles, a 5-D ``(B, H_kv, L / T, D, T)`` tensor (the engine's
opt-in ``kv_v_tiles``, :mod:`~lumenrl_backends.engines.kv_cache`): within a tile the columns are
contiguous, so the p.v operand is K-major (what the MMA's B operand wants, no 8-bit transpose) and
each tile is one contiguous 8 KB (FP8, T = 64) or 16 KB read. ``block_n`` must divide T. Tiles make
the call faster but whole engine steps no faster, since the decode write then scatters
(benchmarks/RESULTS.md, entry ``attention``).
Exposed as the custom op ``lumenrl::gqa_decode_attention`` (opaque to ``torch.compile``, safe
inside CUDA-graph capture: no host sync, buffers from the caching allocator). Works in Triton's
interpreter on CPU too (``TRITON_INTERPRET=1``), which the CPU tests use.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["FP8_DTYPES", "available", "gqa_decode_attention", "gqa_decode_attention_fp8", "kernel_agrees", "supports"]

FP8_DTYPES = frozenset(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton does at import
MAX_ROWS = 64  # packed query rows per KV head (G heads x Q queries) the kernel takes (registers: rows x D fp32)


def available() -> bool:
    return triton is not None


def supports(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Shapes/dtypes the kernel handles: (B, H, Q, D) query with (H / H_kv) * Q <= MAX_ROWS, power-of-two D
    in 32..256, bool mask (B, 1, 1 or Q, L)."""
    d = query.shape[-1]
    return (
        available()
        and (query.shape[1] // max(1, key.shape[1])) * query.shape[2] <= MAX_ROWS
        and key.shape[-1] == d
        and d in (32, 64, 128, 256)
        and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (key.dtype == query.dtype or key.dtype in FP8_DTYPES)
        and mask is not None
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2] in (1, query.shape[2])
        and query.shape[1] % key.shape[1] == 0
    )


if triton is not None:
    from lumenrl_backends.engines.triton_pdl import prefetch_l2, wait_then_release

    @triton.jit
    def _prefetch_first_tile(ptr, b, h, start, kv_len, s_b, s_h, s_l, BLOCK_N: tl.constexpr, D: tl.constexpr,
                             LINE: tl.constexpr):
        """L2 prefetches of columns ``start .. start + BLOCK_N`` (clamped to the cache) of one row and KV head
        of a (B, H_kv, L, D) cache with unit last stride: one per ``LINE`` elements (128 bytes)."""
        cols = tl.minimum(start + tl.arange(0, BLOCK_N), kv_len - 1)
        lines = tl.arange(0, D // LINE) * LINE
        prefetch_l2(ptr + b * s_b + h * s_h + cols.to(tl.int64)[:, None] * s_l + lines[None, :])

    @triton.jit
    def _kv_tile(K, V, b, h, col0, end, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_vd, s_vt, offs_n, offs_d,
                 RUNTIME_BOUNDS: tl.constexpr, K_TRANS: tl.constexpr, V_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
        """Columns ``col0 .. col0 + BLOCK_N`` of one row and KV head: K (or its transpose) and V."""
        cols = col0 + offs_n
        in_range = cols < end
        if K_TRANS:  # K loaded as its (D, BLOCK_N) transpose: the dot's B operand without a tl.trans
            k = tl.load(K + b * s_kb + h * s_kh + cols[None, :] * s_kl + offs_d[:, None], mask=in_range[None, :],
                        other=0.0)
        else:
            k = tl.load(K + b * s_kb + h * s_kh + cols[:, None] * s_kl + offs_d[None, :], mask=in_range[:, None],
                        other=0.0)
        if V_BLOCK > 0:  # V in (D, V_BLOCK) tiles: unmasked (in the allocation; p is 0 past ``end``)
            col0 = tl.multiple_of(col0, BLOCK_N)
            within = tl.multiple_of(col0 % V_BLOCK, BLOCK_N)
            v_ptrs = (V + b * s_vb + h * s_vh + (col0 // V_BLOCK) * s_vt + offs_d[None, :] * V_BLOCK
                      + (within + offs_n)[:, None])
            if RUNTIME_BOUNDS:  # a tile that starts before ``end`` lies inside the cache
                v = tl.load(v_ptrs)
            else:  # the interpreter walks the whole chunk, past the cache's end
                v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vl + offs_d[None, :] * s_vd,
                        mask=in_range[:, None], other=0.0)
        return k, v

    @triton.jit
    def _visible(M, b, s_mb, col0, end, offs_n):
        """Which of columns ``col0 .. col0 + BLOCK_N`` the row may attend to (False past ``end``)."""
        cols = col0 + offs_n
        in_range = cols < end
        return (tl.load(M + b * s_mb + cols, mask=in_range, other=0) != 0) & in_range

    @triton.jit
    def _visible_tile(M, b, s_mb, s_mq, mask_rows, col0, end, offs_n, NQ: tl.constexpr):
        """The tile's visibility: (BLOCK_N,) shared by every packed row (NQ = 1), or (BLOCK_G, BLOCK_N) with
        packed row r reading the mask row of its query, ``mask_rows = r % NQ`` (NQ > 1)."""
        # if / else, not an early return: compiled Triton generates the statements after a static if's
        # return too, and the two return types differ
        if NQ == 1:
            visible = _visible(M, b, s_mb, col0, end, offs_n)
        else:
            cols = col0 + offs_n
            in_range = cols < end
            ptrs = M + b * s_mb + mask_rows[:, None] * s_mq + cols[None, :]
            visible = (tl.load(ptrs, mask=in_range[None, :], other=0) != 0) & in_range[None, :]
        return visible

    @triton.jit
    def _attend(q, q8, q_scale, k, v, allowed, m_i, l_i, acc, scale, K_TRANS: tl.constexpr, FP8_DOTS: tl.constexpr,
                NQ: tl.constexpr = 1):
        """One tile of the online softmax: scores, running max / sum, accumulator."""
        if K_TRANS:
            if FP8_DOTS >= 1:
                qk = tl.dot(q8, k).to(tl.float32) * scale
            else:
                qk = tl.dot(q, k.to(q.dtype)).to(tl.float32) * scale  # (BLOCK_G, BLOCK_N)
        else:
            if FP8_DOTS >= 1:
                qk = tl.dot(q8, tl.trans(k)).to(tl.float32) * scale
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32) * scale  # (BLOCK_G, BLOCK_N)
        if FP8_DOTS >= 1:
            qk = qk * q_scale[:, None]
        if NQ == 1:
            qk = tl.where(allowed[None, :], qk, float("-inf"))
        else:  # a mask row per query: (BLOCK_G, BLOCK_N)
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_DOTS == 2:  # p in [0, 1] scaled to E4M3's range: weights down to ~4e-6 survive the cast
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), v).to(tl.float32) * (1.0 / 448.0)
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype)).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(
        Q, K, V, M, PART, LSE, K_SCALE, V_SCALE, LAST, scale,
        s_qb, s_qh, s_qg, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_vd, s_mb,
        s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls, s_last, s_vt,
        kv_len, s_mq, chunk,
        CHUNK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SCALE: tl.constexpr, HAS_LAST: tl.constexpr, RUNTIME_BOUNDS: tl.constexpr, DIRECT: tl.constexpr,
        K_TRANS: tl.constexpr, FP8_DOTS: tl.constexpr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        V_BLOCK: tl.constexpr = 0, MASK_AHEAD: tl.constexpr = False, NQ: tl.constexpr = 1, PDL: tl.constexpr = False,
        LINE: tl.constexpr = 64, V_ROWS: tl.constexpr = False,
    ):
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b = b.to(tl.int64)  # row offsets: a long cache's b * s_kb passes 2**31 elements (int32 wrapped)
        # compiled, the chunk is a run-time argument: one binary serves every kv_len (at batch >= 2 x SMs / H_kv a
        # split is the whole length, so a constexpr chunk compiled a kernel per 64 columns); the interpreter's
        # loop below needs it constant (CHUNK)
        span = chunk if RUNTIME_BOUNDS else CHUNK
        if PDL:  # the first tile's K (and V rows) to L2 while the previous kernel finishes (triton_pdl)
            _prefetch_first_tile(K, b, h, s * span, kv_len, s_kb, s_kh, s_kl, BLOCK_N, D, LINE)
            if V_ROWS:
                _prefetch_first_tile(V, b, h, s * span, kv_len, s_vb, s_vh, s_vl, BLOCK_N, D, LINE)
        wait_then_release(PDL)  # the query, the new column and ``LAST`` come from earlier kernels
        offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, BLOCK_N)
        g_ok = offs_g < G
        q = tl.load(Q + b * s_qb + h * s_qh + offs_g[:, None] * s_qg + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        if HAS_SCALE and Q.dtype.element_ty != tl.float32:  # FP8 cache, 16-bit query: dots in fp16 (see above)
            q = q.to(tl.float16)
        q8, q_scale = q, tl.full([BLOCK_G], 1.0, tl.float32)
        if FP8_DOTS >= 1:  # E4M3 cache, opt-in: q in E4M3 (per-row scale), q.k on FP8 tensor cores
            q_amax = tl.max(tl.abs(q.to(tl.float32)), 1)
            q_scale = tl.where(q_amax > 0, q_amax / 448.0, 1.0)
            q8 = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
        if HAS_SCALE:  # FP8 cache: dequant scales folded into the scores and the output
            scale = scale * tl.load(K_SCALE)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        start = s * span
        end = tl.minimum(start + span, kv_len)
        if HAS_LAST:  # columns after the row's last visible one are never read (the loop stops there)
            end = tl.minimum(end, tl.load(LAST + b * s_last).to(tl.int32) + 1)
        # compiled: the loop ends at ``end``; the interpreter (CPU tests) cannot take run-time bounds,
        # so it walks the whole chunk with masked (never performed) loads past ``end``: same values
        lo, hi = (start, end) if RUNTIME_BOUNDS else (0, CHUNK)
        # MASK_AHEAD: the next tile's visibility (a small load that feeds no dot, so Triton's pipeliner
        # leaves it synchronous) is loaded one iteration early, in registers
        mask_rows = offs_g % NQ  # packed row r = g * NQ + j (query head g, query j) reads mask row j
        allowed = _visible_tile(M, b, s_mb, s_mq, mask_rows, start, end, offs_n, NQ)
        for n0 in range(lo, hi, BLOCK_N):
            col0 = n0 if RUNTIME_BOUNDS else start + n0
            if MASK_AHEAD:
                allowed_next = _visible_tile(M, b, s_mb, s_mq, mask_rows, col0 + BLOCK_N, end, offs_n, NQ)
            else:
                allowed = _visible_tile(M, b, s_mb, s_mq, mask_rows, col0, end, offs_n, NQ)
            k, v = _kv_tile(K, V, b, h, col0, end, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_vd, s_vt,
                            offs_n, offs_d, RUNTIME_BOUNDS, K_TRANS, V_BLOCK, BLOCK_N)
            m_i, l_i, acc = _attend(q, q8, q_scale, k, v, allowed, m_i, l_i, acc, scale, K_TRANS, FP8_DOTS, NQ)
            if MASK_AHEAD:
                allowed = allowed_next
        _store_split(PART, LSE, V_SCALE, acc, l_i, m_i, b, h, s, offs_g, offs_d, g_ok, s_ob, s_oh, s_os, s_og, s_lb,
                     s_lh, s_ls, HAS_SCALE, DIRECT, OUT_FP8, FP8_MAX)

    @triton.jit
    def _store_split(PART, LSE, V_SCALE, acc, l_i, m_i, b, h, s, offs_g, offs_d, g_ok, s_ob, s_oh, s_os, s_og, s_lb,
                     s_lh, s_ls, HAS_SCALE: tl.constexpr, DIRECT: tl.constexpr, OUT_FP8: tl.constexpr,
                     FP8_MAX: tl.constexpr):
        """A split program's end: the normalised output (one split: final; else a partial and its log-sum-exp)."""
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if OUT_FP8:  # in V's code units: a convex combination of FP8 codes, within +-FP8_MAX
            out = tl.minimum(tl.maximum(out, -FP8_MAX), FP8_MAX)
        elif HAS_SCALE:
            out = out * tl.load(V_SCALE)
        if DIRECT:  # one split: the normalised output is final (no partials, no merge kernel)
            tl.store(PART + b * s_ob + h * s_oh + offs_g[:, None] * s_og + offs_d[None, :],
                     out.to(PART.dtype.element_ty), mask=g_ok[:, None])
        else:
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(PART + b * s_ob + h * s_oh + s * s_os + offs_g[:, None] * s_og + offs_d[None, :], out,
                     mask=g_ok[:, None])
            tl.store(LSE + b * s_lb + h * s_lh + s * s_ls + offs_g, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(
        PART, LSE, OUT, s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls, s_outb, s_outh, s_outg,
        SPLITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        wait_then_release(PDL)  # the partials come from the split kernel
        b, h, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_d = tl.arange(0, D)
        lse_max = tl.full([1], float("-inf"), tl.float32)
        for s in range(0, SPLITS):
            lse_max = tl.maximum(lse_max, tl.load(LSE + b * s_lb + h * s_lh + s * s_ls + g + tl.arange(0, 1)))
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s in range(0, SPLITS):
            lse = tl.load(LSE + b * s_lb + h * s_lh + s * s_ls + g + tl.arange(0, 1))
            w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - lse_max))
            part = tl.load(PART + b * s_ob + h * s_oh + s * s_os + g * s_og + offs_d)
            acc += part * w
            total += w
        res = acc / tl.where(total > 0, total, 1.0)
        if OUT_FP8:
            res = tl.minimum(tl.maximum(res, -FP8_MAX), FP8_MAX)
        tl.store(OUT + b * s_outb + h * s_outh + g * s_outg + offs_d, res.to(OUT.dtype.element_ty))


# Launch configuration: ``block_n`` key columns per loop iteration, ``chunk`` columns per split
# program (0: split so that ``B * H_kv * splits`` covers the multiprocessors about twice, from the
# attended length), ``num_warps``, ``num_stages`` (software pipelining of the K/V loads), ``k_trans``
# (1: load K as its transpose instead of transposing the tile for the dot), ``mask_ahead`` (1: load the
# next tile's visibility mask one iteration early; Triton's pipeliner leaves that load, which feeds no
# dot, synchronous: one exposed memory latency per tile otherwise), ``fp8_dots`` (E4M3 cache only,
# opt-in: 1 casts the query (per-row scale) to E4M3 so q.k runs on FP8 tensor cores without converting
# K, 2 also the probabilities (x 448) for p.v, as FlashAttention-3's FP8 mode; the extra E4M3 rounding
# costs accuracy (2.6e-2 / 3.4e-2 relative error vs 1.7e-3) and measured no faster, so the engine never
# turns it on by itself).
# ``benchmarks/gpu/bench_attention.py --tune`` sweeps these on the GPU; see RESULTS.md.
# Defaults: the fastest at Qwen3-8B heads, batch 64, 384 of 512 columns on an H200 (bf16: k_trans +
# mask_ahead; FP8: 64 columns, 2 warps, 3 stages, mask_ahead); figures in RESULTS.md (entry attention).
# ``config`` keys override the cache dtype's default.
DEFAULT_CONFIG: dict[str, int] = {"block_n": 64, "chunk": 0, "num_warps": 4, "num_stages": 2, "k_trans": 1,
                                  "fp8_dots": 0, "mask_ahead": 1}
FP8_CONFIG: dict[str, int] = {**DEFAULT_CONFIG, "num_warps": 2, "num_stages": 3, "k_trans": 0}
_CONFIG_KEYS = frozenset(DEFAULT_CONFIG)


def _config(config: dict[str, int] | None, fp8: bool = False) -> dict[str, int]:
    cfg = {**(FP8_CONFIG if fp8 else DEFAULT_CONFIG), **(config or {})}
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)}; allowed: {sorted(_CONFIG_KEYS)}")
    for name in ("block_n", "num_warps"):
        value = cfg[name]
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config {name}={value!r}; allowed: a power of two >= 1")
    if cfg["block_n"] < 16:
        raise ValueError(f"config block_n={cfg['block_n']}; allowed: a power of two >= 16 (tl.dot)")
    if not isinstance(cfg["chunk"], int) or cfg["chunk"] < 0 or cfg["chunk"] % cfg["block_n"]:
        raise ValueError(f"config chunk={cfg['chunk']!r}; allowed: 0 (auto) or a multiple of block_n={cfg['block_n']}")
    if cfg["fp8_dots"] not in (0, 1, 2):
        raise ValueError(f"config fp8_dots={cfg['fp8_dots']!r}; allowed: 0 (fp16 dots), 1 (E4M3 q.k), 2 (and E4M3 p.v)")
    if cfg["fp8_dots"] and cfg["block_n"] < 32:
        raise ValueError(f"config block_n={cfg['block_n']} with fp8_dots={cfg['fp8_dots']}; allowed: >= 32 (FP8 MMA K step)")
    if cfg["mask_ahead"] not in (0, 1):
        raise ValueError(f"config mask_ahead={cfg['mask_ahead']!r}; allowed: 0 or 1 (load the next tile's mask early)")
    if cfg["k_trans"] not in (0, 1):
        raise ValueError(f"config k_trans={cfg['k_trans']!r}; allowed: 0 (K rows, transposed in registers) or 1")
    if not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1:
        raise ValueError(f"config num_stages={cfg['num_stages']!r}; allowed: an int >= 1")
    return cfg


def _splits(batch: int, kv_heads: int, kv_len: int, block_n: int) -> int:
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count if torch.cuda.is_available() else 1
    want = max(1, math.ceil(2 * sms / max(1, batch * kv_heads)))
    return max(1, min(want, math.ceil(kv_len / block_n)))


def _run(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
    splits: int | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    last: torch.Tensor | None = None, config: dict[str, int] | None = None, out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    from lumenrl_backends.engines.triton_pdl import launch_options

    batch, kv_heads, groups, dim = query.shape
    n_q = allowed.shape[1] if allowed.dim() == 3 else 1  # queries per head: packed rows g * n_q + j
    if groups % n_q or allowed.shape[0] != batch:
        raise ValueError(f"allowed {tuple(allowed.shape)}: (B, L) or (B, Q, L) with Q dividing the packed rows of "
                         f"query {tuple(query.shape)}")
    out_fp8 = out_dtype is not None and out_dtype in FP8_DTYPES
    if out_fp8 and (k_scale is None or torch.finfo(out_dtype).max < torch.finfo(key.dtype).max):
        raise ValueError(f"out_dtype={out_dtype} needs an FP8 cache whose codes it can hold; got a {key.dtype} cache")
    kv_len = key.shape[2]
    cfg = _config(config, fp8=key.dtype in FP8_DTYPES)
    if cfg["fp8_dots"] and key.dtype != torch.float8_e4m3fn:
        raise ValueError(f"config fp8_dots={cfg['fp8_dots']} needs a float8_e4m3fn cache; got {key.dtype}")
    block_n = cfg["block_n"]
    if splits is None:
        splits = math.ceil(kv_len / cfg["chunk"]) if cfg["chunk"] else _splits(batch, kv_heads, kv_len, block_n)
    chunk = math.ceil(math.ceil(kv_len / splits) / block_n) * block_n
    splits = math.ceil(kv_len / chunk)  # no empty trailing split
    out = torch.empty((batch, kv_heads, groups, dim), dtype=out_dtype if out_fp8 else query.dtype, device=query.device)
    direct, partial, lse, p_strides, l_strides = _split_buffers(out, splits)
    mask = allowed
    has_scale = k_scale is not None
    v_block = value.shape[-1] if value.dim() == 5 else 0
    if v_block:
        if v_block % block_n or value.shape[2] * v_block < kv_len or value.stride(-1) != 1:
            raise ValueError(f"value tiles {tuple(value.shape)} (B, H_kv, L / T, D, T): T={v_block} must be a multiple "
                             f"of block_n={block_n}, cover kv_len={kv_len}, with a unit last stride")
        v_strides = (value.stride(0), value.stride(1), 1, v_block)
    else:
        v_strides = (value.stride(0), value.stride(1), value.stride(2), value.stride(3))
    pdl, extra = launch_options(pdl, query.device)
    line = max(1, 128 // key.element_size())  # elements per 128-byte line (the prefetch granule)
    _split_kernel[(batch, kv_heads, splits)](
        query, key, value, mask, partial, lse, k_scale if has_scale else lse, v_scale if has_scale else lse,
        lse if last is None else last, scale,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        *v_strides, mask.stride(0),
        *p_strides, *l_strides, 0 if last is None else last.stride(0), value.stride(2) if v_block else 0,
        kv_len, mask.stride(1) if n_q > 1 else 0, chunk,
        CHUNK=chunk if _INTERPRETED else 0, G=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK_N=block_n,
        HAS_SCALE=has_scale, HAS_LAST=last is not None, RUNTIME_BOUNDS=not _INTERPRETED, DIRECT=direct,
        K_TRANS=bool(cfg["k_trans"]), FP8_DOTS=cfg["fp8_dots"], OUT_FP8=out_fp8,
        FP8_MAX=torch.finfo(out_dtype).max if out_fp8 else 0.0,
        V_BLOCK=v_block, MASK_AHEAD=bool(cfg["mask_ahead"]), NQ=n_q, PDL=pdl, LINE=min(line, dim),
        V_ROWS=not v_block and value.stride(-1) == 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )
    if not direct:
        _merge(partial, lse, out, out_dtype if out_fp8 else None, pdl, extra)
    return out


def _split_buffers(out: torch.Tensor, splits: int) -> tuple[bool, torch.Tensor, torch.Tensor, tuple, tuple]:
    """(direct, partials, log-sum-exps, their strides) of a split launch writing ``out`` (B, H_kv, G, D): one split
    writes ``out`` itself (the lse pointer unused); more write float32 partials for :func:`_merge`."""
    batch, kv_heads, groups, dim = out.shape
    if splits == 1:
        return True, out.unsqueeze(2), out, out.unsqueeze(2).stride()[:4], (0, 0, 0)
    partial = torch.empty((batch, kv_heads, splits, groups, dim), dtype=torch.float32, device=out.device)
    lse = torch.empty((batch, kv_heads, splits, groups), dtype=torch.float32, device=out.device)
    return False, partial, lse, partial.stride()[:4], lse.stride()[:3]


def _merge(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_fp8: torch.dtype | None, pdl: bool,
           extra: dict) -> None:
    """The merge kernel over a launch's partials into ``out`` (``out_fp8``: codes clamped to that format)."""
    batch, kv_heads, splits, groups, dim = partial.shape
    _merge_kernel[(batch, kv_heads, groups)](
        partial, lse, out, *partial.stride()[:4], *lse.stride()[:3], *out.stride()[:3], SPLITS=splits, G=groups,
        D=dim, OUT_FP8=out_fp8 is not None, FP8_MAX=torch.finfo(out_fp8).max if out_fp8 is not None else 0.0,
        PDL=pdl, **extra,
    )


def _op_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, last: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    return _run(query, key, value, allowed, scale, k_scale=k_scale, v_scale=v_scale, last=last, pdl=pdl)


def _op_fp8_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
    k_scale: torch.Tensor, v_scale: torch.Tensor, last: torch.Tensor | None, out_dtype: torch.dtype,
    pdl: bool = False,
) -> torch.Tensor:
    return _run(query, key, value, allowed, scale, k_scale=k_scale, v_scale=v_scale, last=last, out_dtype=out_dtype,
                pdl=pdl)


def _register(name: str, impl, fake, mutates: tuple[str, ...] = ()):  # noqa: ANN001, ANN202 - torch.library
    """The custom op ``lumenrl::<name>``: registered at import (a registration inside a torch.compile'd
    region would break the graph), only where Triton exists, once per process (a re-import reuses it);
    ``mutates``: the arguments it writes in place."""
    if triton is None:
        return None
    op = getattr(torch.ops.lumenrl, name, None)
    if op is None:
        op = torch.library.custom_op(f"lumenrl::{name}", mutates_args=mutates)(impl)
        op.register_fake(fake)
    return op


_OP = _register("gqa_decode_attention", _op_impl,
                lambda query, key, value, allowed, scale, k_scale=None, v_scale=None, last=None, pdl=False: torch.empty_like(
                    query))
_OP_FP8 = _register("gqa_decode_attention_fp8", _op_fp8_impl,
                    lambda query, key, value, allowed, scale, k_scale, v_scale, last, out_dtype, pdl=False: torch.empty_like(
                        query, dtype=out_dtype))


def _kernel_layout(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K with a unit last stride; V rows (L, D) or columns (D, L), read as stored; else contiguous copies."""
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.dim() == 5:  # (B, H_kv, L / T, D, T) tiles: read as stored (their unit last stride is checked)
        return key, value
    if value.stride(-1) != 1 and value.stride(-2) != 1:
        value = value.contiguous()
    return key, value


def gqa_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, last: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """query (B, H_kv, G, D), key/value (B, H_kv, L, D), allowed (B, L) bool; K with unit last stride, V
    with a unit stride in either of its last two dims (a cache stored (D, L) per head, see the module doc),
    or V in (B, H_kv, L / T, D, T) tiles
    -> (B, H_kv, G, D) in the query dtype.

    Multi-query decode (speculative decoding's verify forward, Q query tokens per row): query
    (B, H_kv, G * Q, D) with packed row ``g * Q + j`` = query head g of the group at query j (a free
    view of the (B, H, Q, D) query), allowed (B, Q, L): row ``g * Q + j`` attends where ``allowed[:, j]``
    (e.g. the row's valid columns up to query j's own column: causal by column). ``last`` must then be
    at or past every query's last allowed column (the engine: the last query's column). FP8 key/value take one-element dequant scales
    ``k_scale``/``v_scale`` (``x = q * scale``), applied in-kernel (no dequantized copy).
    ``last`` (B,) int64, optional: each row's last column that ``allowed`` may mark (the engine's
    write column); later columns are neither read nor computed (bounded loop).
    ``pdl``: launch with programmatic dependent launch where supported (CUDA sm90+): each program prefetches
    its first K/V tile to L2 before waiting for the previous kernel (:mod:`~lumenrl_backends.engines.triton_pdl`)."""
    key, value = _kernel_layout(key, value)
    if k_scale is not None:
        k_scale, v_scale = k_scale.reshape(1).float(), v_scale.reshape(1).float()
    # eager and under CUDA graph capture, the implementation itself: torch.library's dispatch costs more host time
    # than the launch (the engine's capture passes); the registered op where torch.compile traces
    op = _OP if torch.compiler.is_compiling() else _op_impl
    return op(query.contiguous(), key, value, allowed, float(scale), k_scale, v_scale, last, bool(pdl))


def gqa_decode_attention_fp8(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
    k_scale: torch.Tensor, v_scale: torch.Tensor, last: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn, pdl: bool = False,
) -> torch.Tensor:
    """:func:`gqa_decode_attention` over an FP8 cache that returns the output as FP8 codes in V's code
    units: ``out ≈ codes * v_scale``. Each output is a convex combination of V codes (the softmax
    weights sum to 1), so it lies within the cache format's range and ``v_scale`` is a valid static
    scale for it: no amax pass, and the output projection takes the codes directly. ``out_dtype``
    must hold the cache's codes (the same FP8 format, or a wider one). ``pdl``: as :func:`gqa_decode_attention`."""
    key, value = _kernel_layout(key, value)
    if key.dtype not in FP8_DTYPES:
        raise ValueError(f"gqa_decode_attention_fp8 needs an FP8 cache; got key dtype {key.dtype}")
    k_scale, v_scale = k_scale.reshape(1).float(), v_scale.reshape(1).float()
    op = _OP_FP8 if torch.compiler.is_compiling() else _op_fp8_impl  # as gqa_decode_attention
    return op(query.contiguous(), key, value, allowed, float(scale), k_scale, v_scale, last, out_dtype, bool(pdl))


def kernel_agrees(device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16,
                  v_tile: int = 0) -> bool:
    """Run the kernel once on fresh random inputs with a ``cache_dtype`` cache (scaled when FP8), V
    by rows or (``v_tile`` > 0) in (D, v_tile) tiles, and per-row write columns ``last`` (the bounded
    walk the engine uses), and compare with float32 attention over the same values; an error or a
    relative error above 2e-2 -> False with a warning (the engine then dequantizes before SDPA instead)."""
    import warnings

    if not available() or device.type != "cuda":
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(99)
        q = torch.randn((3, 2, 4, 128), generator=gen, device=device).to(dtype)
        k, v = (torch.randn((3, 2, 200, 128), generator=gen, device=device) for _ in range(2))
        allowed = torch.rand((3, 200), generator=gen, device=device) > 0.3
        last = torch.tensor([199, 130, 17], device=device)  # rows end at, past and inside the first split
        columns = torch.arange(200, device=device)
        allowed &= columns <= last[:, None]
        allowed[torch.arange(3, device=device), last] = True
        scales = None
        if cache_dtype in FP8_DTYPES:
            scales = (k.abs().amax() / 240.0).reshape(1), (v.abs().amax() / 240.0).reshape(1)
            k, v = (k / scales[0]).to(cache_dtype), (v / scales[1]).to(cache_dtype)
            k_ref, v_ref = k.float() * scales[0], v.float() * scales[1]
        else:
            k, v = k.to(cache_dtype), v.to(cache_dtype)
            k_ref, v_ref = k.float(), v.float()
        if v_tile:  # the cache's tile layout (kv_cache imports nothing from here: no cycle)
            from lumenrl_backends.engines.kv_cache import value_tiles

            v_in = value_tiles(v, v_tile)
        else:
            v_in = v
        out = gqa_decode_attention(q, k, v_in, allowed, 128**-0.5, *(scales or (None, None)), last=last)
        mask = allowed[:, None, None, :]
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k_ref, v_ref, attn_mask=mask, scale=128**-0.5)
        error = float((out.float() - ref).norm() / ref.norm())
    except Exception as err:  # noqa: BLE001 - the SDPA path is the fallback
        warnings.warn(f"native engine: Triton decode attention unavailable ({type(err).__name__}: {err})", stacklevel=2)
        return False
    if error > 2e-2:
        warnings.warn(f"native engine: Triton decode attention off by {error:.3g}; using SDPA", stacklevel=2)
    return error <= 2e-2
