"""FP8 KV cache: quantize / dequantize K and V with per-tensor or per-head scales, and calibrate them.

Design
------
Static dequant scales (``x ≈ q * scale``) as in :mod:`lumenrl_quant.fp8`, either one per tensor
(``()``) or one per KV head (``(H,)``, broadcast along ``head_axis``; HF layout ``(B, H, T, D)``
has ``head_axis=1``). Values beyond ``scale * fp8_max`` saturate (clamp before cast), never NaN.

Calibration (:func:`calibrate_kv_scales`) follows the reference RL practice: the policy changes
every step, so engines recompute q/k/v scales from a fresh batch after each update as

    scale = percentile(|x|, p) * margin / fp8_max        (p = 99.9, margin = 1.05 by default)

with the nearest-rank percentile (``kthvalue`` of rank ``ceil(p/100 * N)``; ``p = 100`` is the
amax). Groups that are all zero get scale 1. :func:`all_reduce_max_` takes the max over ranks
(when ``torch.distributed`` is initialized) so every rank pushes identical scales with the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lumenrl_quant.fp8 import amax_to_scale, quantize_fp8_with_scale

__all__ = [
    "KVScales",
    "all_reduce_max_",
    "calibrate_kv_scales",
    "dequantize_kv",
    "percentile_amax",
    "quantize_kv",
]


@dataclass(kw_only=True, slots=True)
class KVScales:
    """FP8 KV-cache dequant scales.

    k_scale / v_scale: ``()`` per tensor or ``(H,)`` per head. q_scale: optional query scale (same
    shape rules, for engines that also run attention in FP8). dtype: the FP8 cache dtype.
    head_axis: the head dim of K/V (1 for HF ``(B, H, T, D)``), used by per-head scales.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    q_scale: torch.Tensor | None = None
    dtype: torch.dtype = torch.float8_e4m3fn
    head_axis: int = 1

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to push with the weights: ``k_scale``, ``v_scale`` (+ ``q_scale``)."""
        out = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if self.q_scale is not None:
            out["q_scale"] = self.q_scale
        return out

    def to(self, device: torch.device | str) -> KVScales:
        q = None if self.q_scale is None else self.q_scale.to(device)
        return KVScales(k_scale=self.k_scale.to(device), v_scale=self.v_scale.to(device), q_scale=q,
                        dtype=self.dtype, head_axis=self.head_axis)


def _broadcast(scale: torch.Tensor, x: torch.Tensor, head_axis: int) -> torch.Tensor:
    scale = scale.float()
    if scale.dim() == 0:
        return scale
    axis = head_axis % x.dim()
    if scale.shape != (x.shape[axis],):
        raise ValueError(f"per-head scale shape {tuple(scale.shape)} does not match {x.shape[axis]} heads "
                         f"on head_axis={head_axis} of shape {tuple(x.shape)}")
    shape = [1] * x.dim()
    shape[axis] = -1
    return scale.reshape(shape)


def quantize_kv(
    k: torch.Tensor, v: torch.Tensor, scales: KVScales
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V to FP8 with the static scales (saturating)."""
    qk = quantize_fp8_with_scale(k, _broadcast(scales.k_scale, k, scales.head_axis), dtype=scales.dtype)
    qv = quantize_fp8_with_scale(v, _broadcast(scales.v_scale, v, scales.head_axis), dtype=scales.dtype)
    return qk, qv


def dequantize_kv(
    qk: torch.Tensor, qv: torch.Tensor, scales: KVScales, *, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`quantize_kv`, cast to ``dtype``."""
    k = qk.float() * _broadcast(scales.k_scale, qk, scales.head_axis)
    v = qv.float() * _broadcast(scales.v_scale, qv, scales.head_axis)
    return k.to(dtype), v.to(dtype)


def percentile_amax(x: torch.Tensor, percentile: float = 99.9, *, head_axis: int | None = None) -> torch.Tensor:
    """Nearest-rank percentile of ``|x|``: ``()`` over all, or ``(H,)`` per ``head_axis`` slice."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile={percentile} must be in (0, 100]")
    a = x.detach().abs().float()
    a = a.reshape(1, -1) if head_axis is None else a.movedim(head_axis, 0).reshape(x.shape[head_axis], -1)
    n = a.shape[1]
    if n == 0:
        raise ValueError(f"cannot calibrate on an empty tensor of shape {tuple(x.shape)}")
    rank = min(n, max(1, math.ceil(percentile / 100.0 * n)))
    vals = a.amax(dim=1) if rank == n else a.kthvalue(rank, dim=1).values
    return vals.reshape(()) if head_axis is None else vals


def _scale(x: torch.Tensor, percentile: float, margin: float, per_head: bool, head_axis: int,
           dtype: torch.dtype) -> torch.Tensor:
    amax = percentile_amax(x, percentile, head_axis=head_axis if per_head else None)
    return amax_to_scale(amax * margin, dtype)


def calibrate_kv_scales(
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor | None = None,
    *,
    percentile: float = 99.9,
    margin: float = 1.05,
    per_head: bool = False,
    head_axis: int = 1,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> KVScales:
    """Scales ``percentile(|x|) * margin / fp8_max`` for K, V (and Q) from one batch.

    Call after each policy update with a calibration batch's K/V (e.g. captured from prefill).
    ``per_head`` gives ``(H,)`` scales along ``head_axis`` (query heads for ``q``).
    """
    if margin <= 0:
        raise ValueError(f"margin={margin} must be > 0")
    args = (percentile, margin, per_head, head_axis, dtype)
    q_scale = None if q is None else _scale(q, *args)
    return KVScales(k_scale=_scale(k, *args), v_scale=_scale(v, *args), q_scale=q_scale, dtype=dtype,
                    head_axis=head_axis)


def all_reduce_max_(scales: KVScales, group: object | None = None) -> KVScales:
    """Max-reduce the scales over ranks in place (no-op without an initialized process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        for t in scales.as_dict().values():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return scales
