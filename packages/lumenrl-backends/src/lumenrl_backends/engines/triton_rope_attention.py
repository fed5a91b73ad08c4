"""The decode step's q/k norm, RoPE and KV-cache write folded into the split-KV attention kernel.

Why: between the fused q/k/v GEMM and attention, :mod:`~lumenrl_backends.engines.triton_rope` runs one small
kernel per layer (q/k RMSNorm, RoPE, the K/V write): a few hundred KB of work whose cost is its launch and
its place in the chain (about 3.8 us of marginal step time per layer at Qwen3-8B, batch 64, on an H200).
Here the attention kernel does that work itself (``KernelOptions.rope_in_attention``, opt-in until measured):

* every program ``(row, KV head, split)`` loads the raw query heads of its group from the q/k/v GEMM's output,
  norms and ropes them in registers with the same rounding steps as the RoPE kernel (its ``_norm_rope``), so the
  query the dots see is the one the two-kernel path hands over;
* the program whose split holds the row's write column norms and ropes the new key and writes it and the new
  value into the cache (FP8 codes with the cache's per-tensor scales, as ``_store_kv`` does), then a CTA barrier
  makes the column visible to its own loads, and the walk over the columns is the attention kernel's, unchanged.

Columns are owned by exactly one split, so no program reads a column another program writes. Equivalence: the
RoPE steps round as the RoPE kernel's and the attention arithmetic is the attention kernel's, so in Triton's
interpreter the output and the cache equal the two-kernel path's bit for bit (the CPU test). On a GPU this
kernel keeps the attention kernel's floating-point contraction (FMA), which the RoPE kernel turns off, so a q/k
norm's sum of squares may round differently: a normed value next to a rounding boundary can land one ulp away,
as between the RoPE kernel and torch (the CUDA test bounds it). What it does not take (speculative decoding's multi-query verify
forward, V stored in tiles, FP8 dots, no Triton): the two-kernel path, chosen per call by
:func:`fold_supported`.
"""

from __future__ import annotations

import math

import torch

from lumenrl_backends.engines import triton_attention as ta
from lumenrl_backends.engines.triton_rope import _INTERPRETED, _checked, _fp8_max, _rows

__all__ = ["decode_rope_attention", "fold_for_engine", "fold_supported"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None


if triton is not None:
    from lumenrl_backends.engines.triton_attention import (
        _attend,
        _kv_tile,
        _prefetch_first_tile,
        _store_split,
        _visible,
    )
    from lumenrl_backends.engines.triton_pdl import wait_then_release
    from lumenrl_backends.engines.triton_rope import _norm_rope, _store_kv

    @triton.jit
    def _rope_attention_kernel(
        QR, KR, VR, Q_W, K_W, COS, SIN, K_CACHE, V_CACHE, COLUMNS, M, PART, LSE, K_SCALE, V_SCALE, scale, eps,
        s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_cos, s_sin, s_col, s_kcb, s_kch, s_kcl, s_vcb, s_vch, s_vcl, s_mb,
        s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls, kv_len, chunk,
        CHUNK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_SCALE: tl.constexpr, CACHE_MAX: tl.constexpr, RUNTIME_BOUNDS: tl.constexpr,
        DIRECT: tl.constexpr, K_TRANS: tl.constexpr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        MASK_AHEAD: tl.constexpr, PDL: tl.constexpr, LINE: tl.constexpr, EMULATED: tl.constexpr,
    ):
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b = b.to(tl.int64)
        span = chunk if RUNTIME_BOUNDS else CHUNK  # compiled: one binary for every kv_len (triton_attention)
        if PDL:  # old columns do not depend on the previous kernel (the new one is written below)
            _prefetch_first_tile(K_CACHE, b, h, s * span, kv_len, s_kcb, s_kch, s_kcl, BLOCK_N, D, LINE)
            _prefetch_first_tile(V_CACHE, b, h, s * span, kv_len, s_vcb, s_vch, s_vcl, BLOCK_N, D, LINE)
        wait_then_release(PDL)  # raw q/k/v come from the q/k/v GEMM
        column = tl.load(COLUMNS + b * s_col)
        offs_h = tl.arange(0, D // 2)[None, :]
        cos1 = tl.load(COS + b * s_cos + offs_h).to(tl.float32)
        cos2 = tl.load(COS + b * s_cos + D // 2 + offs_h).to(tl.float32)
        sin1 = tl.load(SIN + b * s_sin + offs_h).to(tl.float32)
        sin2 = tl.load(SIN + b * s_sin + D // 2 + offs_h).to(tl.float32)
        start = s * span
        if (column >= start) & (column < start + span):  # this split owns the new column: norm, rope, write
            k_ptrs = KR + b * s_kb + h * s_kh + offs_h
            k1, k2 = _norm_rope(tl.load(k_ptrs), tl.load(k_ptrs + D // 2), K_W, offs_h, cos1, cos2, sin1, sin2, eps,
                                HAS_NORM, D, EMULATED)
            k_cache = K_CACHE + b * s_kcb + h * s_kch + column * s_kcl + offs_h
            _store_kv(k1, k_cache, K_SCALE, HAS_SCALE, CACHE_MAX)
            _store_kv(k2, k_cache + D // 2, K_SCALE, HAS_SCALE, CACHE_MAX)
            v_ptrs = VR + b * s_vb + h * s_vh + offs_h
            v_cache = V_CACHE + b * s_vcb + h * s_vch + column * s_vcl + offs_h
            _store_kv(tl.load(v_ptrs), v_cache, V_SCALE, HAS_SCALE, CACHE_MAX)
            _store_kv(tl.load(v_ptrs + D // 2), v_cache + D // 2, V_SCALE, HAS_SCALE, CACHE_MAX)
        tl.debug_barrier()  # the column written above is visible to every thread of this program from here
        offs_g2 = tl.arange(0, BLOCK_G)[:, None]
        q_ptrs = QR + b * s_qb + (h * G + offs_g2) * s_qh + offs_h
        g_ok2 = offs_g2 < G
        q1, q2 = _norm_rope(tl.load(q_ptrs, mask=g_ok2, other=0.0), tl.load(q_ptrs + D // 2, mask=g_ok2, other=0.0),
                            Q_W, offs_h, cos1, cos2, sin1, sin2, eps, HAS_NORM, D, EMULATED)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, D))  # [q1 | q2]: the roped heads
        if HAS_SCALE:  # FP8 cache, 16-bit query: dots in fp16 (triton_attention's module doc)
            q = q.to(tl.float16)
            scale = scale * tl.load(K_SCALE)
        offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, BLOCK_N)
        g_ok = offs_g < G
        one = tl.full([BLOCK_G], 1.0, tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        end = tl.minimum(tl.minimum(start + span, kv_len), column.to(tl.int32) + 1)
        lo, hi = (start, end) if RUNTIME_BOUNDS else (0, CHUNK)
        allowed = _visible(M, b, s_mb, start, end, offs_n)
        for n0 in range(lo, hi, BLOCK_N):
            col0 = n0 if RUNTIME_BOUNDS else start + n0
            if MASK_AHEAD:
                allowed_next = _visible(M, b, s_mb, col0 + BLOCK_N, end, offs_n)
            else:
                allowed = _visible(M, b, s_mb, col0, end, offs_n)
            k, v = _kv_tile(K_CACHE, V_CACHE, b, h, col0, end, s_kcb, s_kch, s_kcl, s_vcb, s_vch, s_vcl, 1, 0,
                            offs_n, offs_d, RUNTIME_BOUNDS, K_TRANS, 0, BLOCK_N)
            m_i, l_i, acc = _attend(q, q, one, k, v, allowed, m_i, l_i, acc, scale, K_TRANS, 0, 1)
            if MASK_AHEAD:
                allowed = allowed_next
        _store_split(PART, LSE, V_SCALE, acc, l_i, m_i, b, h, s, offs_g, offs_d, g_ok, s_ob, s_oh, s_os, s_og, s_lb,
                     s_lh, s_ls, HAS_SCALE, DIRECT, OUT_FP8, FP8_MAX)


def fold_supported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   allowed: torch.Tensor) -> bool:
    """Whether :func:`decode_rope_attention` takes these: Triton on CUDA (or its interpreter), one query per row
    (b, H, D) of more heads than the cache's KV heads, a power-of-two head dim of 32..256 that the attention
    kernel takes, V stored by rows, a (b, L) bool mask."""
    dim = query.shape[-1]
    return (triton is not None and (query.is_cuda or _INTERPRETED) and query.dim() == 3 and key_cache.dim() == 4
            and value_cache.dim() == 4 and query.shape[1] % key_cache.shape[1] == 0
            and query.shape[1] // key_cache.shape[1] <= ta.MAX_ROWS and key_cache.shape[1] < query.shape[1]
            and dim in (32, 64, 128, 256) and query.dtype in (torch.bfloat16, torch.float16)
            and allowed.dim() == 2 and allowed.dtype == torch.bool and allowed.shape[0] == query.shape[0])


def _op_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    allowed: torch.Tensor, kv_len: int, scale: float, out_dtype: torch.dtype | None = None, pdl: bool = False,
) -> torch.Tensor:
    from lumenrl_backends.engines.triton_pdl import launch_options

    batch, heads, dim = query.shape
    kv_heads = key_cache.shape[1]
    groups = heads // kv_heads
    fp8 = k_scale is not None
    out_fp8 = out_dtype is not None
    cfg = ta._config(None, fp8=fp8)
    block_n = cfg["block_n"]
    splits = ta._splits(batch, kv_heads, kv_len, block_n)
    chunk = math.ceil(math.ceil(kv_len / splits) / block_n) * block_n
    splits = math.ceil(kv_len / chunk)
    out = torch.empty((batch, kv_heads, groups, dim), dtype=out_dtype if out_fp8 else query.dtype, device=query.device)
    direct, partial, lse, p_strides, l_strides = ta._split_buffers(out, splits)
    pdl, extra = launch_options(pdl, query.device)
    line = max(1, 128 // key_cache.element_size())
    _rope_attention_kernel[(batch, kv_heads, splits)](
        query, key, value, q_weight if q_weight is not None else query, k_weight if k_weight is not None else key,
        cos, sin, key_cache, value_cache, columns, allowed, partial, lse, k_scale if fp8 else cos,
        v_scale if fp8 else cos, float(scale), float(eps),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), sin.stride(0), columns.stride(0), *key_cache.stride()[:3], *value_cache.stride()[:3],
        allowed.stride(0), *p_strides, *l_strides, kv_len, chunk,
        CHUNK=chunk if _INTERPRETED else 0, G=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK_N=block_n,
        HAS_NORM=q_weight is not None, HAS_SCALE=fp8, CACHE_MAX=_fp8_max(key_cache.dtype) if fp8 else 0.0,
        RUNTIME_BOUNDS=not _INTERPRETED, DIRECT=direct, K_TRANS=bool(cfg["k_trans"]), OUT_FP8=out_fp8,
        FP8_MAX=torch.finfo(out_dtype).max if out_fp8 else 0.0, MASK_AHEAD=bool(cfg["mask_ahead"]), PDL=pdl,
        LINE=min(line, dim), EMULATED=_INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **extra,
    )
    if not direct:
        ta._merge(partial, lse, out, out_dtype, pdl, extra)
    return out


def _op_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
             k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, allowed: torch.Tensor, kv_len: int, scale: float,
             out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    batch, heads, dim = query.shape
    kv_heads = key_cache.shape[1]
    return query.new_empty((batch, kv_heads, heads // kv_heads, dim), dtype=out_dtype or query.dtype)


_OP = ta._register("decode_rope_attention", _op_impl, _op_fake, mutates=("key_cache", "value_cache"))


def decode_rope_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, columns: torch.Tensor, allowed: torch.Tensor, kv_len: int,
    scale: float, *, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode token per row, raw query (b, H, D) and key/value (b, H_kv, D) from the q/k/v GEMM (unit last
    stride): q/k RMSNorm (with ``q_weight``/``k_weight``), RoPE, K/V written into the caches (S, H_kv, L, D) at
    ``[i, :, columns[i]]`` (as :func:`~lumenrl_backends.engines.triton_rope.decode_qk_rope_kv_write`), then
    grouped-query attention of each row over its first ``kv_len`` columns where ``allowed`` (b, kv_len) marks
    them, ending at its write column (as :func:`~lumenrl_backends.engines.triton_attention.gqa_decode_attention`
    with ``last=columns``) -> (b, H_kv, G, D). An FP8 cache takes one-element ``k_scale``/``v_scale``;
    ``out_dtype`` (an FP8 dtype, FP8 cache only): the output as codes in V's units
    (:func:`~lumenrl_backends.engines.triton_attention.gqa_decode_attention_fp8`)."""
    _checked(query[:, None], key[:, None], value[:, None], cos[:, None], sin[:, None], key_cache, value_cache,
             columns[:, None], q_weight, k_weight, k_scale, v_scale)
    if not fold_supported(query, key_cache, value_cache, allowed) or allowed.shape[1] < kv_len:
        raise ValueError(f"decode_rope_attention: query {tuple(query.shape)} {query.dtype}, cache "
                         f"{tuple(key_cache.shape)}, allowed {tuple(allowed.shape)} {allowed.dtype}, kv_len {kv_len}: "
                         "not taken (fold_supported says what is)")
    if out_dtype is not None and (k_scale is None or torch.finfo(out_dtype).max < torch.finfo(key_cache.dtype).max):
        raise ValueError(f"out_dtype={out_dtype} needs an FP8 cache whose codes it can hold; got {key_cache.dtype}")
    if k_scale is not None:
        k_scale, v_scale = k_scale.reshape(1).float(), v_scale.reshape(1).float()
    query, key, value, cos, sin = (_rows(t) for t in (query, key, value, cos, sin))
    allowed = allowed if allowed.stride(-1) == 1 else allowed.contiguous()
    op = _OP if torch.compiler.is_compiling() else _op_impl  # eager / captured: no dispatch (triton_linear)
    return op(query, key, value, q_weight, k_weight, float(eps), cos, sin, key_cache, value_cache, columns, k_scale,
              v_scale, allowed, int(kv_len), float(scale), out_dtype, bool(pdl))


def fold_for_engine(
    module: torch.nn.Module, cache: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None, attention_mask: torch.Tensor | None,
    fp8_out: torch.dtype | None, pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The engine's fused attention (``engines/fusion.py``), one decode step: query (b, 1, H, D) and key/value
    (b, 1, H_kv, D) straight from the q/k/v GEMM -> (the attention output (b, 1, H, D), or FP8 codes in V's units
    when ``fp8_out`` applies; the V scale of those codes, else None), or None where the two-kernel path runs
    (the same conditions as the RoPE op's, plus :func:`fold_supported`)."""
    batch, q_len, heads, dim = query.shape
    view = getattr(cache, "view", None)
    if q_len != 1 or view is None or value.shape[-1] != dim:
        return None
    if view.rope is not None:  # the engine's once-per-step tables
        position_embeddings = view.rope
    if position_embeddings is None or attention_mask is None or attention_mask.dim() != 4:
        return None
    cos, sin = position_embeddings
    if cos.shape != (batch, 1, dim) or sin.shape != cos.shape or cos.dtype != query.dtype or sin.dtype != cos.dtype:
        return None
    norms = (module.q_norm, module.k_norm) if hasattr(module, "q_norm") else None
    if norms is not None and (norms[0].weight.dtype != query.dtype or norms[1].weight.dtype != query.dtype):
        return None
    if attention_mask.shape[1:3] != (1, 1) or attention_mask.dtype != torch.bool:
        return None
    target = cache.decode_write_target(module.layer_idx, key.transpose(1, 2), value.transpose(1, 2))
    allowed = attention_mask[:, 0, 0]
    if target is None or not fold_supported(query[:, 0], target.keys, target.values, allowed):
        return None
    out_dtype = fp8_out if (fp8_out is not None and target.k_scale is not None
                            and torch.finfo(fp8_out).max >= torch.finfo(target.keys.dtype).max) else None
    out = decode_rope_attention(
        query[:, 0], key[:, 0], value[:, 0], cos[:, 0], sin[:, 0], target.keys, target.values, target.columns[:, 0],
        allowed, view.kv_len, module.scaling, q_weight=None if norms is None else norms[0].weight,
        k_weight=None if norms is None else norms[1].weight, eps=1e-6 if norms is None else norms[0].variance_epsilon,
        k_scale=target.k_scale, v_scale=target.v_scale, out_dtype=out_dtype, pdl=pdl)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), (target.v_scale if out_dtype is not None else None)
