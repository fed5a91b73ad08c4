"""Context parallel (DeepSpeed-Ulysses) attention for HF decoder families.

Design: the ``cp`` ranks of a group each hold one contiguous chunk of every sequence
(``S_l = S / cp`` tokens; :func:`shard_sequence`), with the GLOBAL position ids, so embeddings,
norms, MLPs and RoPE run on the local chunk unchanged. Only attention needs the whole sequence:
the registered attention function ``lumenrl_ulysses`` exchanges with one all-to-all

    q (B, H, S_l, D) -> (B, H/cp, S, D)      [heads sharded, sequence whole]

(and k, v likewise with the KV heads), runs causal SDPA on whole sequences with H/cp heads, and
exchanges the output back to ``(B, S_l, H, D)``. Both all-to-alls are differentiable
(``_functional_collectives.all_to_all_single_autograd``): the backward is the inverse exchange.
Parameters are replicated over cp; their gradients are summed over the cp ranks by FSDP2 when cp
is part of the sharding dim (torchtitan's ``dp_shard_cp``), or by the caller.

Padding: the backend passes the whole rows' key-padding mask as a 4-D ``(B, 1, 1, S)`` bool
tensor (transformers hands a 4-D mask to the attention function untouched); after the exchange
each query attends causally to the valid keys, and to itself (a padding query thus never sees an
empty row, so padded positions stay finite and are never read by valid ones). Without padding the
mask is None and SDPA runs ``is_causal``. Valid positions equal the unsharded masked forward.

:func:`sequence_chunk` lays a padded ``(B, L)`` batch out for rank ``cp_rank`` (columns padded on the
right to a multiple of cp: causal, so earlier tokens are unchanged); :func:`gather_sequence` puts
the per-chunk results back together on every rank (differentiable: its backward sums the
gradients of the cp ranks, which hold identical losses, so the caller scales by the dp size only).
:func:`context_parallel_forward` is the training backend's forward of RL rows with both.

Limits (refused): cp must divide the query heads and the KV heads. Packed varlen rows are not
exchanged by this attention function (the backend trims pad columns instead of packing); sliding
windows are not applied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lumenrl_backends.training.modeling import decoder_layers

__all__ = ["ATTENTION_NAME", "context_parallel_forward", "enable_ulysses", "gather_sequence", "sequence_chunk",
           "shard_sequence"]

ATTENTION_NAME = "lumenrl_ulysses"


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Differentiable equal-split all-to-all along dim 0 (its backward is the inverse exchange)."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(send, None, None, group or torch.distributed.group.WORLD)
    return funcol.wait_tensor(out)


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, H, S_l, D) on each rank -> (B, H/cp, cp*S_l, D): rank r keeps head block r, all chunks."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, S_l, D)
    recv = _all_to_all(send, group)  # [src chunk] (cp, B, H/cp, S_l, D)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, H/cp, S, D) -> (B, H, S/cp, D): the inverse of :func:`_seq_to_heads`."""
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, S_l, D)
    recv = _all_to_all(send, group)  # [src head block]
    return recv.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


def _ulysses_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_: Any):
    group, cp = module._lumenrl_cp_group, module._lumenrl_cp
    q, k, v = (_seq_to_heads(t, group, cp) for t in (query, key, value))  # (B, H/cp, S, D), (B, Hkv/cp, S, D)
    mask = None
    if attention_mask is not None:  # (B, 1, 1, S) valid keys -> causal over valid keys, plus the diagonal
        s = q.shape[2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = (attention_mask & causal) | torch.eye(s, dtype=torch.bool, device=q.device)  # (B, 1, S, S)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
        dropout_p=dropout if module.training else 0.0, enable_gqa=q.shape[1] != k.shape[1],
    )
    return _heads_to_seq(out, group, cp).transpose(1, 2).contiguous(), None  # (B, S_l, H, D)


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    return None  # no 2-D mask given: causal whole rows (SDPA's is_causal on the gathered sequence)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def enable_ulysses(model: nn.Module, cp_group, cp: int) -> nn.Module:
    """Route every attention layer of ``model`` through the Ulysses exchange over ``cp_group``."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    bad = [f"{k}={v}" for k, v in (("num_attention_heads", heads), ("num_key_value_heads", kv)) if v % cp]
    if bad:
        raise ValueError(f"policy.parallel.cp={cp} does not divide {', '.join(bad)} of {cfg.model_type}")
    _register()
    for layer in decoder_layers(model):
        layer.self_attn._lumenrl_cp_group, layer.self_attn._lumenrl_cp = cp_group, cp
    cfg._attn_implementation = ATTENTION_NAME
    return model


def shard_sequence(input_ids: torch.Tensor, cp_rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's chunk of ``input_ids`` (B, S) and its global ``position_ids`` (B, S/cp)."""
    b, s = input_ids.shape
    if s % cp:
        raise ValueError(f"policy.parallel.cp={cp} does not divide the sequence length {s}")
    lo, hi = cp_rank * (s // cp), (cp_rank + 1) * (s // cp)
    positions = torch.arange(lo, hi, device=input_ids.device).expand(b, -1)
    return input_ids[:, lo:hi], positions


def sequence_chunk(inputs: dict[str, torch.Tensor], cp_rank: int, cp: int) -> tuple[dict[str, torch.Tensor], int]:
    """Rank ``cp_rank``'s model inputs of (B, L) ``input_ids``/``attention_mask``/``position_ids`` (global
    positions), columns padded on the right to a multiple of cp, and the chunk's first column."""
    length = inputs["input_ids"].shape[1]
    pad = (0, (-length) % cp)
    ids, mask, pos = (F.pad(inputs[k], pad) for k in ("input_ids", "attention_mask", "position_ids"))  # (B, Lp)
    size = ids.shape[1] // cp
    lo, hi = cp_rank * size, (cp_rank + 1) * size
    keys = None if bool(mask.all()) else mask.bool()[:, None, None, :]  # (B, 1, 1, Lp) valid keys
    return {"input_ids": ids[:, lo:hi], "position_ids": pos[:, lo:hi], "attention_mask": keys}, lo


def gather_sequence(local: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, S/cp) per rank -> (b, S) on every rank, in rank order (differentiable: the backward
    reduce-scatters, i.e. sums the cp ranks' gradients of the whole tensor)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd  # torch < 2.10
    full = funcol.wait_tensor(gather(local.transpose(0, 1).contiguous(), 0, group))
    return full.transpose(0, 1)  # (S, b) -> (b, S)


def context_parallel_forward(model: nn.Module, inputs: dict[str, torch.Tensor], cp_mesh, token_fn=None):
    """Results for the T response tokens of (b, L) rows, whole on every rank of ``cp_mesh``.

    This rank runs its chunk ``[lo, lo + S_l)``. ``token_fn(logits (b, n, V), tokens (b, n))`` returns a
    tuple of (b, n) results (or None) for the n response tokens predicted inside the chunk (only those
    positions reach the LM head); without it the model returns one value per position (a critic).
    """
    cp, group = cp_mesh.size(), cp_mesh.get_group()
    L, T = inputs["input_ids"].shape[1], inputs["responses"].shape[1]
    chunk, lo = sequence_chunk(inputs, cp_mesh.get_local_rank(), cp)
    size = chunk["input_ids"].shape[1]

    def whole(local: torch.Tensor) -> torch.Tensor:  # (b, S_l) -> (b, T) on every cp rank
        return gather_sequence(local, group, cp)[:, L - T - 1 : L - 1]

    if token_fn is None:
        return whole(model(**chunk))
    first, last = min(max(L - T - 1, lo), lo + size), max(min(L - 1, lo + size), lo)  # predicting columns here
    keep = torch.arange(first - lo, last - lo, device=chunk["input_ids"].device)
    logits = model(**chunk, logits_to_keep=keep, use_cache=False).logits  # (b, last - first, V)
    results = token_fn(logits, inputs["responses"][:, first - (L - T - 1) : last - (L - T - 1)])
    pad = (first - lo, lo + size - last)
    return tuple(whole(F.pad(r, pad)) if r is not None else None for r in results)
