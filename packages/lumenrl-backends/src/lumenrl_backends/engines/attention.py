"""Decode attention for the native engine: grouped-query attention without ``repeat_kv``.

transformers' ``sdpa`` path expands K/V to every query head (``repeat_kv``) whenever an explicit
mask is given on CUDA, because SDPA's fused GQA mode needs ``attn_mask=None``. In decode that
copy reads the whole cache, writes it ``n_rep`` times larger and reads it again: for Qwen3-8B
(32 query / 8 KV heads) five passes over the cache instead of one.

For one query token per sequence all ``n_rep`` query heads of a group share K, V and the mask,
so the query can be *packed*: ``(B, H, 1, D) -> (B, H_kv, n_rep, D)`` and attention runs once
per KV head with ``n_rep`` query rows (one pass over the cache; the mask ``(B, 1, 1, L)``
broadcasts). The result is the same function: every query row still attends to its own keys.
On CUDA (with Triton) the packed attention runs in the split-KV kernel of
:mod:`~lumenrl_backends.engines.triton_attention`, which stops each row at its write column (read
from the engine cache's decode view: columns past it are masked anyway, and under
``compile="full"`` the view spans ``max_seq_len``, so the bound saves the unused tail's reads);
elsewhere through SDPA.

FP8 KV cache: in decode the slot cache returns its FP8 storage as is (no dequantized copy of the
cache per layer and step) and records the layer's scales on itself (``current_scales``); this
function reads them through the cache passed to :func:`engine_attention`, and either hands the
FP8 tensors and scales to the kernel or dequantizes them here (CPU, per-head scales, other shapes)
with lumenrl-quant's ``dequantize_kv``, the same math as the cache's own decode. A cache that stores V
in tiles (:data:`~lumenrl_backends.engines.kv_cache.V_TILE`) hands them over 5-D: the kernel reads them as
stored, every other path here takes rows (:func:`~lumenrl_backends.engines.kv_cache.value_rows`).

:func:`packed_decode_attention` keeps the signature of transformers' attention functions and
falls back to the original ``sdpa`` function for everything else (prefill, no GQA, no mask). It is registered with
transformers under its own name, :data:`ENGINE_ATTENTION`, and :func:`use_engine_attention` sets that name on the
engine's model only (where it ran ``sdpa``; masks are built as for ``sdpa``): transformers' own ``sdpa`` entry is
never replaced, so another model in the process (an async trainer's policy or reference model, compiled or not,
in any thread) never reaches this function. :func:`engine_attention` marks an engine forward in progress: the
cache whose views and FP8 scales this function reads (inside a CUDA-graph capture, once, at capture). A call from
a thread other than that forward's goes to transformers' ``sdpa`` (the engine's model driven from two threads at
once; not traced: a compiled forward is the engine's own). Engine forwards in different threads take turns (a
process-wide re-entrant lock): the active cache is process-wide state. Graph replays do not enter it.

A packed prefill (sequences back to back in one batch row) whose cache view says ``varlen`` (the engine's choice,
where :func:`varlen_ok` holds) runs torch's varlen flash attention (``torch.nn.attention.varlen``, causal within each
sequence, over the view's ``segments``); elsewhere the engine passes a block-diagonal causal mask
(:func:`~lumenrl_backends.engines.kv_cache.packed_mask`) and this falls back to ``sdpa`` like any prefill.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lumenrl_backends.engines import triton_attention
from lumenrl_backends.engines.kv_cache import value_rows

__all__ = ["ENGINE_ATTENTION", "engine_attention", "packed_decode_attention", "use_engine_attention", "varlen_ok"]

ENGINE_ATTENTION = "lumenrl_engine"  # the attention implementation name of an engine's model (module doc)
# The active cache is process-wide, so engine forwards take turns: two engines in two threads would otherwise read
# each other's FP8 scales and write columns. Re-entrant: a forward inside a forward (same thread) nests and
# restores the outer one's state.
_FORWARDS = threading.RLock()
_ACTIVE_CACHE: list = [None]  # the engine cache of the forward in progress (FP8 decode reads its scales)
_OWNER: list = [None]  # the thread running that forward: a call of the routed model from another thread is not its


def _original_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def packed_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (B, H, 1, D), key/value (B, H_kv, L, D), mask (B, 1, 1, L) -> (B, 1, H, D_v).

    Multi-query decode (speculative decoding's verify forward: the engine's decode view with Q columns per
    row, mask (B, 1, Q, L)): query (B, H, Q, D) -> (B, Q, H, D_v), packed as (B, H_kv, G * Q, D) (row
    ``g * Q + j``: head g of the group, query j; each row masked by its query's mask row), so K/V are read
    once per KV head here too (:mod:`~lumenrl_backends.engines.triton_attention`). Any other Q > 1 (prefill)
    goes to transformers' ``sdpa``.

    ``lumenrl_fp8_out`` (keyword, an FP8 dtype; the engine's fused attention passes it when the output
    projection takes per-token FP8 input): over the engine's FP8 cache with one V scale, the output is
    returned as FP8 codes in V's code units (``out ≈ codes * v_scale``, see
    :func:`~lumenrl_backends.engines.triton_attention.gqa_decode_attention_fp8`), on every device;
    otherwise it is ignored and the output is in the query's dtype. ``lumenrl_pdl`` (keyword, bool; the
    engine's fused attention passes True under ``KernelOptions.pdl``): the Triton kernel launches with
    programmatic dependent launch (:mod:`~lumenrl_backends.engines.triton_pdl`); ignored elsewhere."""
    fp8_out = kwargs.pop("lumenrl_fp8_out", None)
    pdl = kwargs.pop("lumenrl_pdl", False)
    if _foreign_thread():  # the routed model driven from another thread while an engine forward runs: transformers' own
        return _original_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    view = getattr(_ACTIVE_CACHE[0], "view", None)
    if view is not None and view.varlen:
        return _varlen_prefill(query, key, value, view.segments, view.longest, scaling), None
    batch, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    d_v = value.shape[-2] if value.dim() == 5 else value.shape[-1]  # 5-D: the cache's V tiles (B, H_kv, n, D, T)
    columns = _view_columns(batch)  # (B, q): the engine's decode view, else None
    packable = q_len == 1 or (columns is not None and columns.shape[1] == q_len)  # a decode step or a verify forward
    kv_scales = v_scale = None
    if key.dtype in triton_attention.FP8_DTYPES:  # the engine's FP8 cache, as stored (decode only)
        kv_scales = _ACTIVE_CACHE[0].current_scales
        kernel_scales = kv_scales.k_scale.numel() == 1 and kv_scales.v_scale.numel() == 1
        if fp8_out is not None and kernel_scales and packable and torch.finfo(fp8_out).max >= torch.finfo(key.dtype).max:
            v_scale = kv_scales.v_scale
        if not (query.is_cuda and kernel_scales and packable and kv_heads < heads
                and triton_attention.supports(query, key, attention_mask)):
            from lumenrl_quant import dequantize_kv

            key, value = dequantize_kv(key, value_rows(value, key.shape[2]), kv_scales, dtype=query.dtype)
            kv_scales = None
    mask_ok = (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
               and attention_mask.shape[2] in (1, q_len))
    if not packable or kv_heads == heads or not mask_ok or kwargs.get("softcap") is not None or dropout:
        out, weights = _original_sdpa()(
            module, query, key, value_rows(value, key.shape[2]), attention_mask, dropout=dropout, scaling=scaling,
            **kwargs
        )
        return (out if v_scale is None else _codes(out, v_scale, fp8_out)), weights
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * q_len, query.shape[-1])  # (B, H_kv, G * Q, D)
    last = None if columns is None else columns[:, -1]  # the last (largest) write column: no later key is read
    rows_mask = attention_mask[:, 0, 0] if q_len == 1 else attention_mask[:, 0].expand(batch, q_len, -1)  # (B[, Q], L)
    if rows_mask.stride(-1) != 1:
        rows_mask = rows_mask.contiguous()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if v_scale is not None and kv_scales is not None:  # the kernel writes the codes
        out = triton_attention.gqa_decode_attention_fp8(
            packed, key, value, rows_mask, scale, kv_scales.k_scale, v_scale, last=last, out_dtype=fp8_out, pdl=pdl,
        )
    elif query.is_cuda and triton_attention.supports(query, key, attention_mask):
        out = triton_attention.gqa_decode_attention(
            packed, key, value, rows_mask, scale,
            k_scale=None if kv_scales is None else kv_scales.k_scale,
            v_scale=None if kv_scales is None else kv_scales.v_scale,
            last=last, pdl=pdl,
        )
    else:  # SDPA over the packed rows: each packed row g * Q + j takes mask row j
        mask = attention_mask if q_len == 1 else attention_mask[:, :, None].expand(
            batch, 1, groups, q_len, attention_mask.shape[-1]).reshape(batch, 1, groups * q_len, -1)
        out = F.scaled_dot_product_attention(packed, key, value_rows(value, key.shape[2]), attn_mask=mask,
                                             scale=scaling)
    if v_scale is not None and out.dtype != fp8_out:  # dequantized path: the same codes, from the float output
        out = _codes(out, v_scale, fp8_out)
    return out.reshape(batch, heads, q_len, d_v).transpose(1, 2).contiguous(), None


def _foreign_thread() -> bool:
    """Whether this call comes from a thread other than the engine forward's in progress (none in progress: a direct
    call, the caller's own). Inside a compiled forward (``compile="full"``, traced in the engine's thread) it is not
    asked: the trace holds no thread check."""
    return not torch.compiler.is_compiling() and _OWNER[0] is not None and _OWNER[0] != threading.get_ident()


@functools.cache
def _varlen_kwargs() -> dict[str, Any] | None:
    """Keywords that make torch's ``varlen_attn`` causal and grouped-query across the torch versions that have it
    (``window_size=(-1, 0)`` or ``is_causal=True``; ``enable_gqa`` where it exists), or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return {**causal, **({"enable_gqa": True} if "enable_gqa" in params else {})}


def varlen_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a packed prefill of this device, dtype and head size runs torch's varlen flash attention (CUDA,
    16-bit, head size <= 256, a torch that has it); elsewhere it takes a block-diagonal mask through ``sdpa``."""
    return (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and head_dim % 8 == 0 and _varlen_kwargs() is not None)


def _varlen_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor,
                    longest: int, scaling: float | None) -> torch.Tensor:
    """query (1, H, T, D), key/value (1, H_kv, T, D) of sequences back to back (offsets ``segments`` (n + 1,) int32)
    -> (1, T, H, D): each token attends causally within its own sequence."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs = dict(_varlen_kwargs() or {})
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D)
    if "enable_gqa" not in kwargs and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, segments, segments, longest, longest, scale=scaling, **kwargs)
    return out[None]


def _codes(out: torch.Tensor, v_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float attention output over an FP8 cache as codes in V's units (what the kernel writes)."""
    limit = torch.finfo(dtype).max
    return (out.float() / v_scale.float().reshape(1)).clamp(-limit, limit).to(dtype)


def _view_columns(batch: int) -> torch.Tensor | None:
    """(B, q) cache columns the decode rows write, from the active engine cache's decode view; None outside
    the engine's decode. q > 1 (the verify forward): increasing within a row, so the last is the largest."""
    cache = _ACTIVE_CACHE[0]
    view = getattr(cache, "view", None)
    if view is None or not view.decode or view.columns.shape[0] != batch:
        return None
    return view.columns


def _write_columns(batch: int) -> torch.Tensor | None:
    """(B,) last cache column each decode row writes (its last visible key: the mask never allows a later
    column), from the active engine cache's decode view; None outside the engine's decode."""
    columns = _view_columns(batch)
    return None if columns is None else columns[:, -1]


def use_engine_attention(model: torch.nn.Module) -> bool:
    """Route ``model``'s attention through :func:`packed_decode_attention` by name (:data:`ENGINE_ATTENTION`,
    registered with transformers with ``sdpa``'s mask builder) where it runs ``sdpa``; other implementations
    (``eager``, exact mode's, a Ulysses exchange) are left as they are. Only this model's configs change; a
    config object it shares with another model routes that one too, which outside an engine forward computes
    what ``sdpa`` computes (one-token queries packed, everything else through ``sdpa``). Returns whether the
    model is routed."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) in ("sdpa", ENGINE_ATTENTION)}
    if not configs:
        return False
    ALL_ATTENTION_FUNCTIONS.register(ENGINE_ATTENTION, packed_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ENGINE_ATTENTION, sdpa_mask)
    for config in configs.values():
        config._attn_implementation = ENGINE_ATTENTION
    return True


@contextlib.contextmanager
def engine_attention(cache: Any = None) -> Iterator[None]:
    """An engine forward in progress in this thread over ``cache``, the engine's slot cache (its view and
    ``current_scales``, read by :func:`packed_decode_attention` in the model that :func:`use_engine_attention`
    routed). Forwards in other threads wait; a nested one restores the outer one's state."""
    with _FORWARDS:
        previous_cache, previous_owner = _ACTIVE_CACHE[0], _OWNER[0]
        _ACTIVE_CACHE[0], _OWNER[0] = cache, threading.get_ident()
        try:
            yield
        finally:
            _ACTIVE_CACHE[0], _OWNER[0] = previous_cache, previous_owner
