"""The decode step's q/k RMSNorm, RoPE and KV-cache write as one Triton kernel, for the native engine.

Why: in decode (one new token per row) everything between the fused q/k/v GEMM and attention is
elementwise work on a few hundred KB, and its cost is launches, not bytes. On an H200, Qwen3-8B
under ``compile="full"`` (torch.compile + CUDA graphs), batch 64, inductor emitted two kernels per
layer there: q_norm + RoPE on the query (4.6 us/layer) and k_norm + RoPE + FP8 quantize + the
``index_put`` of K and V into the slot cache (2.2 us/layer). This module does all of it in one
kernel (target ~2-2.5 us/layer), exposed as the custom op ``lumenrl::decode_qk_rope_kv_write``:
opaque to ``torch.compile`` (one op in the graph; the cache writes are declared mutations, which
inductor re-inplaces) and safe inside CUDA-graph capture (no host sync; the query output comes
from the caching allocator; scales, columns and the cache are read through stable pointers).

What it computes, per row ``i`` (``rows = arange(b)``: the engine's decode view) and head:

* ``q_norm`` / ``k_norm`` (Qwen3, Qwen3-MoE; skipped when no weights are given, e.g. Llama), as
  HF's RMSNorm does it: float32 ``x * rsqrt(mean(x^2) + eps)``, rounded to the model dtype, then
  ``weight * x`` in the model dtype (a float32 product rounded once);
* RoPE as HF's ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` with
  ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, each product and the sum rounded to the model dtype;
* K and V into the layer's cache ``(S, H_kv, L, D)`` at ``[i, :, columns[i]]``: as they are (a
  16-bit cache), or FP8 codes ``clamp(x / scale, -fp8_max, fp8_max)`` with one static float32
  scale per tensor (lumenrl-quant's ``quantize_fp8_with_scale``, the cache's own codec);
* the roped query, returned as a contiguous ``(b, H, 1, D)`` tensor (what attention packs).

Exact vs approximate: :func:`reference_decode_qk_rope_kv_write` (torch) is the HF op sequence
itself, bit for bit (the engine tests compare it with the unfused path); it runs on CPU and
wherever Triton is missing. The kernel repeats every rounding step: a product of two 16-bit
values is exact in float32, so ``(a * b)`` rounded once to bf16 is torch's bf16 product, and a
sum of two is rounded once as torch's bf16 add does; the FP8 division is IEEE (``div_rn``) and the
cast rounds to nearest even, as torch's. Only the norm's reduction order and ``rsqrt`` differ from
torch's, so a normalised value next to a rounding boundary can land one 16-bit ulp away (and move
an FP8 code). Without q/k norms the kernel is bitwise HF. Inductor's kernels for the unfused
sequence do not round each intermediate to bf16 (``emulate_precision_casts`` is off by default: on
CPU about half of the bf16 outputs of norm + RoPE differ from eager), so under ``compile="full"``
this op is closer to the eager HF model than the kernels it replaces.

Kernel: one program per (row, KV head) handles the ``G = H / H_kv`` query heads of that group as
two ``(G, D/2)`` tiles (the halves that ``rotate_half`` swaps: RoPE is ``x1 cos1 - x2 sin1 | x2
cos2 + x1 sin2``, contiguous loads only), plus the group's K and V rows (Qwen3-8B, b = 64: 512
programs of 4 x 128 query values, one warp each). Head dims: powers of two, 2..256. In Triton's
CPU interpreter (tests) float32 -> bf16 casts truncate, so the kernel rounds the bits itself there.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lumenrl_backends.engines.triton_attention import FP8_DTYPES

__all__ = ["decode_qk_rope_kv_write", "reference_decode_qk_rope_kv_write", "rms_norm", "rope", "head_dim_supported",
           "hf_mismatch"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton does at import
MAX_HEAD_DIM = 256


def head_dim_supported(dim: int) -> bool:
    """The kernel's head dims: powers of two from 2 to 256 (``tl.arange`` and the half rotation)."""
    return 2 <= dim <= MAX_HEAD_DIM and dim & (dim - 1) == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (Llama/Qwen3 ``*RMSNorm.forward``), the same op sequence."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor: x (b, H, D), cos/sin (b, D) -> (b, H, D); or x
    (b, Q, H, D), cos/sin (b, Q, D) -> (b, Q, H, D)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def hf_mismatch(
    apply_rotary_pos_emb: Any, q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None, head_dim: int
) -> str | None:
    """None when an attention's pieces compute what this op computes, else why not: the family's
    ``apply_rotary_pos_emb`` and the module's q/k norms (None: none) against :func:`rope` and
    :func:`rms_norm`, bit for bit on small random inputs (norms on their own device and dtype)."""
    if not head_dim_supported(head_dim):
        return f"head_dim {head_dim} is not a power of two in 2..{MAX_HEAD_DIM}"
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn((2, 4, 1, head_dim), generator=gen), torch.randn((2, 2, 1, head_dim), generator=gen)
    cos, sin = torch.randn((2, 1, head_dim), generator=gen), torch.randn((2, 1, head_dim), generator=gen)
    try:
        q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    except (TypeError, ValueError, RuntimeError) as err:
        return f"the family's apply_rotary_pos_emb fails on (b, H, 1, D) inputs: {err}"
    if not (torch.equal(q_hf[:, :, 0], rope(q[:, :, 0], cos[:, 0], sin[:, 0]))
            and torch.equal(k_hf[:, :, 0], rope(k[:, :, 0], cos[:, 0], sin[:, 0]))):
        return "the family's apply_rotary_pos_emb is not q * cos + rotate_half(q) * sin"
    if q_norm is None and k_norm is None:
        return None
    eps = getattr(q_norm, "variance_epsilon", None)
    for norm in (q_norm, k_norm):
        weight = getattr(norm, "weight", None)
        if (weight is None or tuple(weight.shape) != (head_dim,) or not isinstance(eps, float)
                or getattr(norm, "variance_epsilon", None) != eps):
            return f"q/k norms ({type(q_norm).__name__}) are not RMSNorms over the head dim with one eps"
        x = torch.randn((2, 3, head_dim), generator=gen).to(weight)
        with torch.no_grad():
            if not torch.equal(norm(x), rms_norm(x, weight, eps)):
                return f"{type(norm).__name__} does not compute HF's RMSNorm"
    return None


def reference_decode_qk_rope_kv_write(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The op in torch, exactly the HF sequence the engine runs unfused (arguments: see
    :func:`decode_qk_rope_kv_write`; 3-D arguments are the Q = 1 case) -> query (b, H, Q, D)."""
    query, key, value, cos, sin, columns = _multi(query, key, value, cos, sin, columns)
    if q_weight is not None:
        query, key = rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps)
    query, key = rope(query, cos, sin), rope(key, cos, sin)  # (b, Q, H, D), (b, Q, H_kv, D)
    if k_scale is not None:  # the cache's FP8 codec (FP8KVCodec.encode -> lumenrl_quant.quantize_kv)
        from lumenrl_quant import quantize_fp8_with_scale

        key = quantize_fp8_with_scale(key, k_scale.reshape(()), dtype=key_cache.dtype)
        value = quantize_fp8_with_scale(value, v_scale.reshape(()), dtype=value_cache.dtype)
    rows = torch.arange(query.shape[0], device=columns.device)[:, None]  # (b, 1) against columns (b, Q)
    key_cache[rows, :, columns] = key.to(key_cache.dtype)  # (b, Q, H_kv, D) at [i, :, columns[i, j]]
    if value_cache.dim() == 5:  # (S, H_kv, L / T, D, T) tiles: column c is [..., c // T, :, c % T]
        tile = value_cache.shape[-1]
        value_cache[rows, :, columns // tile, :, columns % tile] = value.to(value_cache.dtype)
    else:
        value_cache[rows, :, columns] = value.to(value_cache.dtype)
    return query.transpose(1, 2).contiguous()  # (b, H, Q, D)


def _multi(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One query per row, 3-D (b, H, D) / cos (b, D) / columns (b,), as the Q = 1 case of the 4-D form
    (views, no copy); 4-D arguments as they are."""
    if query.dim() == 3:
        return query[:, None], key[:, None], value[:, None], cos[:, None], sin[:, None], columns[:, None]
    return query, key, value, cos, sin, columns


if triton is not None:
    from lumenrl_backends.engines.triton_pdl import wait_then_release

    @triton.jit
    def _round(x, dt: tl.constexpr, EMULATED: tl.constexpr):
        """float32 -> ``dt``, to nearest even. Triton's interpreter truncates float32 -> bfloat16 (GPUs
        round), so there the bits are rounded first and the cast of the rounded value is exact."""
        if EMULATED and dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dt)

    @triton.jit
    def _norm_rope(x1, x2, w_ptr, offs_h, cos1, cos2, sin1, sin2, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                   EMULATED: tl.constexpr):
        """Heads as their halves x1 = x[:, :D/2], x2 = x[:, D/2:] (G, D/2) -> RMSNorm (optional) + RoPE, each
        step rounded to the model dtype as HF rounds it; returns the output halves.
        rotate_half(x) = cat(-x2, x1), so RoPE is x1 cos1 - x2 sin1 | x2 cos2 + x1 sin2."""
        dt: tl.constexpr = x1.dtype
        if HAS_NORM:
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)[:, None]
            w1 = tl.load(w_ptr + offs_h).to(tl.float32)  # (1, D/2)
            w2 = tl.load(w_ptr + D // 2 + offs_h).to(tl.float32)
            x1 = _round(w1 * _round(a * rstd, dt, EMULATED).to(tl.float32), dt, EMULATED)
            x2 = _round(w2 * _round(b * rstd, dt, EMULATED).to(tl.float32), dt, EMULATED)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        out1 = _round(_round(a * cos1, dt, EMULATED).to(tl.float32) + _round(-b * sin1, dt, EMULATED).to(tl.float32),
                      dt, EMULATED)
        out2 = _round(_round(b * cos2, dt, EMULATED).to(tl.float32) + _round(a * sin2, dt, EMULATED).to(tl.float32),
                      dt, EMULATED)
        return out1, out2

    @triton.jit
    def _store_kv(x, ptrs, SCALE, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
        if FP8:  # quantize_fp8_with_scale: IEEE x / scale, saturate, round to the FP8 format
            codes = tl.math.div_rn(x.to(tl.float32), tl.load(SCALE).to(tl.float32))
            x = tl.minimum(tl.maximum(codes, -FP8_MAX), FP8_MAX)
        tl.store(ptrs, x.to(ptrs.dtype.element_ty))

    @triton.jit
    def _decode_qk_rope_kv_kernel(
        Q, K, V, Q_W, K_W, COS, SIN, K_CACHE, V_CACHE, COLUMNS, K_SCALE, V_SCALE, Q_OUT,
        s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_cos, s_sin, s_col, s_kcb, s_kch, s_kcl, s_vcb, s_vch, s_vcl,
        s_ob, s_oh, eps, s_vct, n_q, s_qq, s_kq, s_vq, s_cosq, s_sinq, s_colq, s_oq,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr,
        FP8_MAX: tl.constexpr, EMULATED: tl.constexpr, V_TILE: tl.constexpr = 0, PDL: tl.constexpr = False,
    ):
        wait_then_release(PDL)  # q/k/v come from the previous kernel (triton_pdl's contract)
        # program (row * n_q + j, KV head): query j of the row; int64: row * cache stride > 2**31
        pid, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row, j = pid // n_q, pid % n_q
        offs_h = tl.arange(0, D // 2)[None, :]  # (1, D/2): columns of the first half; + D/2: the second
        COS = COS + row * s_cos + j * s_cosq
        SIN = SIN + row * s_sin + j * s_sinq
        cos1 = tl.load(COS + offs_h).to(tl.float32)
        cos2 = tl.load(COS + D // 2 + offs_h).to(tl.float32)
        sin1 = tl.load(SIN + offs_h).to(tl.float32)
        sin2 = tl.load(SIN + D // 2 + offs_h).to(tl.float32)
        column = tl.load(COLUMNS + row * s_col + j * s_colq)
        offs_g = tl.arange(0, BLOCK_G)[:, None]
        g_ok = offs_g < G
        heads = kv_head * G + offs_g  # (BLOCK_G, 1): the query heads of this KV head
        q_ptrs = Q + row * s_qb + j * s_qq + heads * s_qh + offs_h
        q1, q2 = _norm_rope(tl.load(q_ptrs, mask=g_ok, other=0.0), tl.load(q_ptrs + D // 2, mask=g_ok, other=0.0),
                            Q_W, offs_h, cos1, cos2, sin1, sin2, eps, HAS_NORM, D, EMULATED)
        out_ptrs = Q_OUT + row * s_ob + j * s_oq + heads * s_oh + offs_h
        tl.store(out_ptrs, q1, mask=g_ok)
        tl.store(out_ptrs + D // 2, q2, mask=g_ok)
        k_ptrs = K + row * s_kb + j * s_kq + kv_head * s_kh + offs_h  # (1, D/2)
        k1, k2 = _norm_rope(tl.load(k_ptrs), tl.load(k_ptrs + D // 2), K_W, offs_h, cos1, cos2, sin1, sin2, eps,
                            HAS_NORM, D, EMULATED)
        k_cache = K_CACHE + row * s_kcb + kv_head * s_kch + column * s_kcl + offs_h
        _store_kv(k1, k_cache, K_SCALE, FP8, FP8_MAX)
        _store_kv(k2, k_cache + D // 2, K_SCALE, FP8, FP8_MAX)
        v_ptrs = V + row * s_vb + j * s_vq + kv_head * s_vh + offs_h
        if V_TILE > 0:  # (D, V_TILE) tiles: the column's D values are V_TILE apart
            v_cache = V_CACHE + row * s_vcb + kv_head * s_vch + (column // V_TILE) * s_vct + column % V_TILE
            _store_kv(tl.load(v_ptrs), v_cache + offs_h * V_TILE, V_SCALE, FP8, FP8_MAX)
            _store_kv(tl.load(v_ptrs + D // 2), v_cache + (D // 2 + offs_h) * V_TILE, V_SCALE, FP8, FP8_MAX)
        else:
            v_cache = V_CACHE + row * s_vcb + kv_head * s_vch + column * s_vcl + offs_h
            _store_kv(tl.load(v_ptrs), v_cache, V_SCALE, FP8, FP8_MAX)
            _store_kv(tl.load(v_ptrs + D // 2), v_cache + D // 2, V_SCALE, FP8, FP8_MAX)


def _num_warps(block_g: int, dim: int) -> int:
    """One warp per 512 tile elements, 1..4: small tiles, many programs (the kernel is latency-bound)."""
    return max(1, min(4, block_g * dim // 512))


def _fp8_max(dtype: torch.dtype) -> float:
    from lumenrl_quant import fp8_max

    return fp8_max(dtype)


def _launch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    pdl: bool = False,
) -> torch.Tensor:
    from lumenrl_backends.engines.triton_pdl import launch_options

    query, key, value, cos, sin, columns = _multi(query, key, value, cos, sin, columns)
    batch, n_q, heads, dim = query.shape
    kv_heads = key.shape[2]
    out = torch.empty((batch, heads, n_q, dim), dtype=query.dtype, device=query.device)
    fp8 = k_scale is not None
    group = heads // kv_heads
    block_g = triton.next_power_of_2(group)
    pdl, extra = launch_options(pdl, query.device)
    _decode_qk_rope_kv_kernel[(batch * n_q, kv_heads)](
        query, key, value, q_weight if q_weight is not None else query, k_weight if k_weight is not None else key,
        cos, sin, key_cache, value_cache, columns, k_scale if fp8 else cos, v_scale if fp8 else cos, out,
        query.stride(0), query.stride(2), key.stride(0), key.stride(2), value.stride(0), value.stride(2),
        cos.stride(0), sin.stride(0), columns.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), float(eps), value_cache.stride(2) if value_cache.dim() == 5 else 0,
        n_q, query.stride(1), key.stride(1), value.stride(1), cos.stride(1), sin.stride(1), columns.stride(1),
        out.stride(2),
        G=group, BLOCK_G=block_g, D=dim, HAS_NORM=q_weight is not None, FP8=fp8,
        FP8_MAX=_fp8_max(key_cache.dtype) if fp8 else 0.0, EMULATED=_INTERPRETED,
        V_TILE=value_cache.shape[-1] if value_cache.dim() == 5 else 0, PDL=pdl,
        num_warps=_num_warps(block_g, dim), **extra,
        enable_fp_fusion=False,  # no a * b + c -> fma: every product is rounded to the model dtype, as in torch
    )
    return out


def _uses_kernel(cache: torch.Tensor) -> bool:
    return triton is not None and (cache.is_cuda or _INTERPRETED)


def _op_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    pdl: bool = False,
) -> torch.Tensor:
    if _uses_kernel(key_cache):
        return _launch(query, key, value, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, columns, k_scale,
                       v_scale, pdl)
    return reference_decode_qk_rope_kv_write(query, key, value, q_weight, k_weight, eps, cos, sin, key_cache,
                                             value_cache, columns, k_scale, v_scale)


def _op_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, columns: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    pdl: bool = False,
) -> torch.Tensor:
    if query.dim() == 3:  # (b, H, D) -> (b, H, 1, D)
        return query.new_empty((query.shape[0], query.shape[1], 1, query.shape[2]))
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))  # (b, H, Q, D)


def _register():  # noqa: ANN202 - a torch.library CustomOpDef
    """``lumenrl::decode_qk_rope_kv_write``, registered at import (a registration inside a compiled
    region would break the graph), once per process. Registered with or without Triton: without it
    the op runs the torch reference, still one opaque op to ``torch.compile``."""
    op = getattr(torch.ops.lumenrl, "decode_qk_rope_kv_write", None)
    if op is None:
        op = torch.library.custom_op("lumenrl::decode_qk_rope_kv_write", mutates_args=("key_cache", "value_cache"))(
            _op_impl)
        op.register_fake(_op_fake)
    return op


_OP = _register()


def _checked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, columns: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or layout the op cannot take (4-D form:
    the Q = 1 case of 3-D arguments is checked after :func:`_multi`)."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"query (b, H, D) or (b, Q, H, D), key and value (b, H_kv, D) or (b, Q, H_kv, D) expected; "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batch, n_q, heads, dim = query.shape
    if key.shape[:2] != (batch, n_q) or key.shape[3] != dim or heads % key.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} does not fit query {tuple(query.shape)}: same b, Q and D, H_kv "
                         "dividing H")
    if not head_dim_supported(dim):
        raise ValueError(f"head dim {dim} is not supported; allowed: a power of two from 2 to {MAX_HEAD_DIM}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (batch, n_q, dim) or t.dtype != query.dtype:
            raise ValueError(f"{name}: ({batch}, {n_q}, {dim}) in {query.dtype} expected; got {tuple(t.shape)} "
                             f"{t.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight: give both (q/k RMSNorm) or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (dim,) or w.dtype != query.dtype):
            raise ValueError(f"{name}: ({dim},) in {query.dtype} expected; got {tuple(w.shape)} {w.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        tiles = name == "value_cache" and cache.dim() == 5  # (S, H_kv, L / T, D, T): V in (D, T) tiles
        if (cache.dim() != (5 if tiles else 4) or cache.shape[0] < batch or cache.shape[1] != key.shape[2]
                or cache.shape[3 if not tiles else -2] != dim or cache.stride(-1) != 1):
            raise ValueError(f"{name}: (S >= {batch}, {key.shape[2]}, L, {dim}) with unit last stride expected"
                             f"{' (value_cache also (S, H_kv, L / T, D, T) tiles)' if name == 'value_cache' else ''}; "
                             f"got {tuple(cache.shape)} strides {cache.stride()}")
    if columns.shape != (batch, n_q) or columns.dtype != torch.int64:
        raise ValueError(f"columns: ({batch},) or ({batch}, {n_q}) int64 expected; got {tuple(columns.shape)} "
                         f"{columns.dtype}")
    fp8 = key_cache.dtype in FP8_DTYPES
    if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None) or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"an FP8 cache takes k_scale and v_scale, a {query.dtype} cache neither; got cache "
                         f"{key_cache.dtype}/{value_cache.dtype}, k_scale {k_scale is not None}, v_scale {v_scale is not None}")
    if fp8 and (k_scale.numel() != 1 or v_scale.numel() != 1):
        raise ValueError(f"k_scale/v_scale: one element each (per-tensor scales); got {tuple(k_scale.shape)}, "
                         f"{tuple(v_scale.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_qk_rope_kv_write(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, columns: torch.Tensor, *,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, pdl: bool = False,
) -> torch.Tensor:
    """One decode token per row: q/k RMSNorm (when ``q_weight``/``k_weight`` are given), RoPE, and
    K/V written into the cache; returns the roped query (b, H, 1, D), contiguous.

    Multi-query decode (speculative decoding's verify forward): query (b, Q, H, D), key/value
    (b, Q, H_kv, D), cos/sin (b, Q, D) and columns (b, Q) -> query (b, H, Q, D). Every (row, query)
    is normed, roped and written at its own column ``columns[i, j]``, exactly as Q separate one-token
    steps would (the 3-D form is the Q = 1 case). Precondition: a row's Q columns are distinct (two
    writes to one column would race); the engine's verify forward writes ``col_i + arange(Q)``, distinct
    by construction, and attention bounds each query by its own column.

    query (b, H, D), key/value (b, H_kv, D): any strides with a unit last one (e.g. the q/k/v
    slices of one fused projection output; no copy); cos/sin (b, D) in the query's dtype;
    key_cache/value_cache (S, H_kv, L, D), S >= b, written in place at ``[i, :, columns[i]]`` for
    rows ``i = 0..b-1`` (value_cache may instead be (S, H_kv, L / T, D, T) tiles, written at
    ``[i, :, c // T, :, c % T]``, see :mod:`~lumenrl_backends.engines.kv_cache`); columns (b,) int64. An FP8 cache takes one-element float32 dequant scales
    ``k_scale``/``v_scale`` and stores ``clamp(x / scale)`` codes; a cache in the model dtype takes
    neither. See the module docstring for the rounding (the HF sequence). ``pdl``: launch with programmatic
    dependent launch where supported (CUDA sm90+; :mod:`~lumenrl_backends.engines.triton_pdl`)."""
    if query.dim() == 3 and key.dim() == 3 and value.dim() == 3 and columns.dim() == 1:
        query, key, value, cos, sin, columns = _multi(query, key, value, cos, sin, columns)
    _checked(query, key, value, cos, sin, key_cache, value_cache, columns, q_weight, k_weight, k_scale, v_scale)
    query, key, value, cos, sin = (_rows(t) for t in (query, key, value, cos, sin))
    op = _OP if torch.compiler.is_compiling() else _op_impl  # eager / captured: no dispatch (triton_linear)
    return op(query, key, value, q_weight, k_weight, float(eps), cos, sin, key_cache, value_cache, columns,
              k_scale, v_scale, bool(pdl))
