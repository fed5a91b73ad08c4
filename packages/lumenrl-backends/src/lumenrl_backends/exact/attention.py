"""Batch-invariant attention: every query reduces over its keys in *rank* order, in fixed blocks.

The same token sees the same keys in the engine and in the trainer, but at different cache
columns: the engine left-pads prompts (a row's keys start at its pad width) and appends decoded
tokens one column at a time; the trainer packs sequences into rows (a segment starts anywhere) or
trims columns. Walking keys by column would group different keys into a block. Here a query's
allowed keys (always one contiguous run of columns in these layouts: causal within the sequence,
after its padding, or the one column a padding query sees) are renumbered 0..n-1 from the run's
first column, and the reduction runs over rank blocks of :data:`BLOCK_KEYS`: block j holds ranks
[j*B, (j+1)*B) whatever the layout, so decode (one query against the cache) and causal prefill or
training (all queries at once) add the same numbers in the same order.

Per query row (scores in float32, ``scale`` applied after the dot):

    s_r = scale * <q, k_{start+r}>            r < n   (-inf beyond n)
    m = max_r s_r,  p_r = exp(s_r - m)
    l = sum_j sum_{r in block j} p_r,   acc = sum_j sum_{r in block j} p_r v_{start+r}   (j ascending)
    out = acc / l

CPU: the formula above with inner-axis sums (a block's sum has the fixed length B; blocks are
added in a Python loop; trailing all-masked blocks add exact zeros). CUDA: the Triton kernel of
:mod:`~lumenrl_backends.exact.triton_ops` (one program per query row and KV head, the group's
query heads together, online softmax over the same rank blocks), identical for decode and training.

:func:`exact_attention` has the signature of transformers' attention functions and is registered as
``"lumenrl_exact"`` in ``ALL_ATTENTION_FUNCTIONS`` (its mask function: the boolean ``sdpa`` mask,
never skipped for ``is_causal``). A missing mask means causal with the queries at the end.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lumenrl_backends.exact.ops import _use_triton, vector_safe

__all__ = ["ATTN_NAME", "BLOCK_KEYS", "exact_attention", "key_runs", "register"]

ATTN_NAME = "lumenrl_exact"
BLOCK_KEYS = 16


_LOCAL = threading.local()  # per thread (engine and trainer may run at once): (mask, its version, runs)


def key_runs(mask: torch.Tensor | None, q_len: int, kv_len: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, count) (B, Lq) int32: first allowed key column and number of allowed keys per query.

    Computed once per mask: the layers of one forward share the mask tensor, so the result is kept for
    the same object at the same version (an in-place change of the mask recomputes; a CUDA graph
    records the computation at its first layer and replays it)."""
    last = getattr(_LOCAL, "runs", None)
    if mask is not None and last is not None and last[0] is mask and last[1] == mask._version:
        return last[2]
    runs = _key_runs(mask, q_len, kv_len, batch, device)
    if mask is not None:
        _LOCAL.runs = (mask, mask._version, runs)
    return runs


def _key_runs(mask: torch.Tensor | None, q_len: int, kv_len: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if mask is None:
        q = torch.arange(q_len, device=device)
        count = (kv_len - q_len + q + 1).to(torch.int32)
        return torch.zeros(batch, q_len, dtype=torch.int32, device=device), count.expand(batch, q_len).contiguous()
    if mask.dtype != torch.bool:
        raise TypeError(f"exact attention needs a boolean mask (got {mask.dtype}); use attn '{ATTN_NAME}' masks")
    allowed = mask[:, 0] if mask.dim() == 4 else mask  # (B, Lq, Lk)
    allowed = allowed.expand(batch, q_len, kv_len)
    count = allowed.sum(-1, dtype=torch.int32)
    start = allowed.to(torch.uint8).argmax(-1).to(torch.int32)  # first True (0 when none; count is 0 then)
    return start.contiguous(), count.contiguous()


def _attention_cpu(q, k, v, start, count, scale: float) -> torch.Tensor:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D), start/count (B, Lq) -> (B, H, Lq, Dv) in q's dtype."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G, nb = H // Hkv, -(-Lk // BLOCK_KEYS)
    ranks = torch.arange(nb * BLOCK_KEYS, device=q.device)
    valid = ranks < count[..., None].long()  # (B, Lq, NK)
    cols = (start[..., None].long() + ranks).clamp(max=Lk - 1)  # (B, Lq, NK)
    kk = torch.gather(k.float()[:, :, None].expand(B, Hkv, Lq, Lk, D), 3,
                      cols[:, None, :, :, None].expand(B, Hkv, Lq, cols.shape[-1], D))  # (B, Hkv, Lq, NK, D)
    vv = torch.gather(v.float()[:, :, None].expand(B, Hkv, Lq, Lk, Dv), 3,
                      cols[:, None, :, :, None].expand(B, Hkv, Lq, cols.shape[-1], Dv))
    qf = q.float().reshape(B, Hkv, G, Lq, 1, D)
    s = (qf * kk[:, :, None]).sum(-1) * scale  # (B, Hkv, G, Lq, NK): inner-axis dots of length D
    s = s.masked_fill(~valid[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = vector_safe(torch.exp, s - m)  # masked: exactly 0
    vt = vv.transpose(-1, -2)  # (B, Hkv, Lq, Dv, NK)
    total = acc = None
    for j in range(nb):
        blk = slice(j * BLOCK_KEYS, (j + 1) * BLOCK_KEYS)
        pb = p[..., blk].contiguous()  # (B, Hkv, G, Lq, BK)
        lb = pb.sum(-1)
        ab = (pb[..., None, :] * vt[:, :, None, :, :, blk]).sum(-1)  # (B, Hkv, G, Lq, Dv)
        total, acc = (lb, ab) if total is None else (total + lb, acc + ab)
    out = acc / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out.reshape(B, H, Lq, Dv).to(q.dtype)


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query (B, H, Lq, D), key/value (B, Hkv, Lk, D) -> (B, Lq, H, D)."""
    if dropout:
        raise ValueError("exact attention has no dropout (set attention_dropout=0)")
    if kwargs.get("softcap") is not None or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("exact attention supports neither logit softcapping nor attention sinks")
    B, H, Lq, D = query.shape
    scale = float(scaling) if scaling is not None else D**-0.5
    start, count = key_runs(attention_mask, Lq, key.shape[2], B, query.device)
    if _use_triton(query):
        from lumenrl_backends.exact import triton_ops

        out = triton_ops.attention(query, key, value, start, count, scale)  # (B, Lq, H, Dv)
        return out, None
    out = _attention_cpu(query, key, value, start, count, scale)
    return out.transpose(1, 2).contiguous(), None


def _exact_mask(*args: Any, **kwargs: Any):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the attention and its (boolean, never skipped) mask with transformers (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, exact_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, _exact_mask)
