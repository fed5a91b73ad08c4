"""FP8 quantize / dequantize at tensor, row and block granularity.

Design
------
Scale convention (the one every function in this package uses): **dequant scales**.

    q = saturate(x / scale)  cast to FP8          x ≈ q * scale          scale = amax / fp8_max

``amax`` is the largest magnitude in the scaled group; an all-zero group gets ``scale = 1``.
With ``power_of_two_scale=True`` the scale is rounded *up* to a power of two (exactly, via
``frexp``), so ``x / scale`` stays inside the FP8 range and scaling itself is lossless.

Granularities and scale shapes, for ``x`` of shape ``(..., M, K)``:

==============  ========================  ====================================================
granularity     scale shape               use
==============  ========================  ====================================================
``tensorwise``  ``()``                    one scale for the whole tensor
``rowwise``     ``(..., M, 1)``           per token (activations) or per output channel (weights)
``block``       ``(..., ⌈M/bm⌉, ⌈K/bk⌉)``  ``block_size=(1, 128)`` activations (per-token group),
                                           ``(128, 128)`` weights (DeepSeek-V3 ``weight_scale_inv``)
==============  ========================  ====================================================

Non-divisible shapes (block granularity): the tensor is zero-padded internally to whole blocks,
the trailing partial block gets its own scale from its real elements, and ``q`` is returned
with the *unpadded* shape ``(..., M, K)`` while ``scale`` has the ceil-divided shape above.
:func:`dequantize_fp8` with the same ``block_size`` inverts this exactly.

Every cast clamps to ``±fp8_max`` first: torch <= 2.11 turns E4M3 overflow into NaN while
torch >= 2.12 saturates, and the results here must not depend on the version. Math is float32.
Exact: the scale (and its power-of-two rounding). Approximate: the FP8 cast, round-to-nearest-even.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from lumenrl_quant.formats import fp8_max

__all__ = [
    "GRANULARITIES",
    "Granularity",
    "amax_to_scale",
    "dequantize_fp8",
    "expand_block_scale",
    "quantize_fp8",
    "quantize_fp8_with_scale",
    "round_scale_to_power_of_two",
]

Granularity = Literal["tensorwise", "rowwise", "block"]
GRANULARITIES: tuple[str, ...] = ("tensorwise", "rowwise", "block")


def round_scale_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Round positive scales up to the next power of two, exactly (powers of two are kept)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    pow2 = torch.ldexp(torch.ones_like(scale), exponent)
    return torch.where(mantissa == 0.5, scale, pow2)


def amax_to_scale(
    amax: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, power_of_two_scale: bool = False
) -> torch.Tensor:
    """Dequant scale ``amax / fp8_max`` in float32; groups with ``amax == 0`` get scale 1."""
    amax = amax.float()
    # divide by a tensor, not a Python scalar: CUDA turns `t / scalar` into `t * (1 / scalar)`,
    # which is not correctly rounded and would make GPU scales differ from CPU scales by an ulp
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fp8_max(dtype)), torch.ones_like(amax))
    return round_scale_to_power_of_two(scale) if power_of_two_scale else scale


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = fp8_max(dtype)
    return (x / scale).clamp_(-limit, limit).to(dtype)


def _check_block_size(block_size: tuple[int, int] | None) -> tuple[int, int]:
    if block_size is None:
        return (1, 128)
    if len(block_size) != 2 or any(int(b) < 1 for b in block_size):
        raise ValueError(f"block_size={block_size!r} must be two positive ints, e.g. (1, 128) or (128, 128)")
    return int(block_size[0]), int(block_size[1])


def _pad_to_blocks(x: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    m, k = x.shape[-2:]
    pad_m, pad_k = (-m) % bm, (-k) % bk
    return F.pad(x, (0, pad_k, 0, pad_m)) if pad_m or pad_k else x


def _quantize_blocks(
    x: torch.Tensor, dtype: torch.dtype, bm: int, bk: int, power_of_two_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 2:
        raise ValueError(f"granularity='block' needs x with >= 2 dims (..., M, K); got shape {tuple(x.shape)}")
    m, k = x.shape[-2:]
    xp = _pad_to_blocks(x.float(), bm, bk)
    *lead, mp, kp = xp.shape
    xb = xp.reshape(*lead, mp // bm, bm, kp // bk, bk)  # (..., Mb, bm, Kb, bk)
    scale = amax_to_scale(xb.abs().amax(dim=(-3, -1)), dtype, power_of_two_scale=power_of_two_scale)
    q = _cast(xb, scale[..., :, None, :, None], dtype).reshape(*lead, mp, kp)
    if (mp, kp) != (m, k):
        q = q[..., :m, :k].contiguous()
    return q, scale


def quantize_fp8(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: Granularity = "tensorwise",
    block_size: tuple[int, int] | None = None,
    power_of_two_scale: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8; returns ``(q, scale)`` with ``x ≈ q * scale`` (see module doc).

    ``block_size`` applies to ``granularity="block"`` only (default ``(1, 128)``).
    ``backend``: ``"auto"`` (fused Triton kernel on GPU when available and the shape divides,
    else torch), ``"torch"``, or ``"triton"`` (raises if the Triton kernel cannot run).
    ``power_of_two_scale`` runs the torch path (``"auto"`` picks it); ``"triton"`` refuses it (the
    kernels compute ``amax / fp8_max`` scales).
    """
    fp8_max(dtype)  # validates dtype
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} is not supported; allowed: ['auto', 'torch', 'triton']")
    if backend == "triton" and power_of_two_scale:
        raise ValueError("backend='triton' with power_of_two_scale=True: the Triton kernels do not round scales "
                         "to powers of two; allowed: backend='torch' or 'auto' with it, or power_of_two_scale=False")
    if backend != "torch" and not power_of_two_scale:
        out = _try_triton(x, dtype, granularity, block_size, strict=backend == "triton")
        if out is not None:
            return out
    return _quantize_fp8_torch(x, dtype, granularity, block_size, power_of_two_scale)


def _try_triton(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: tuple[int, int] | None, *, strict: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    from lumenrl_quant import triton_kernels as tk

    usable = tk.triton_available(x.device) and x.dim() >= 1 and x.numel() > 0
    if not usable:
        if strict:
            raise RuntimeError(f"backend='triton' needs triton and a GPU tensor; got device={x.device}")
        return None
    k = x.shape[-1]
    try:
        if granularity == "tensorwise":
            return tk.fp8_quantize_tensorwise(x, dtype)
        x2 = x.reshape(-1, k)
        if granularity == "rowwise":
            q, s = tk.fp8_quantize_groups(x2, k, dtype)
            return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)
        bm, bk = _check_block_size(block_size) if granularity == "block" else (0, 0)
        if (bm, bk) == (1, 128) and k % 128 == 0:
            q, s = tk.fp8_quantize_groups(x2, 128, dtype)
            return q.reshape(x.shape), s.reshape(*x.shape[:-1], k // 128)
        if (bm, bk) == (128, 128) and k % 128 == 0 and x.dim() == 2:
            return tk.fp8_quantize_blocks(x, 128, dtype)
    except (RuntimeError, ValueError):
        if strict:
            raise
        return None
    if strict:
        raise ValueError(f"no Triton kernel for granularity={granularity!r}, block_size={block_size}, "
                         f"shape {tuple(x.shape)}")
    return None


def _quantize_fp8_torch(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: tuple[int, int] | None,
    power_of_two_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if granularity == "tensorwise":
        xf = x.float()
        scale = amax_to_scale(xf.abs().amax(), dtype, power_of_two_scale=power_of_two_scale)
        return _cast(xf, scale, dtype), scale
    if granularity == "rowwise":
        if x.dim() < 1:
            raise ValueError(f"granularity='rowwise' needs x with >= 1 dim (..., M, K); got shape {tuple(x.shape)}")
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)  # (..., M, 1)
        scale = amax_to_scale(amax, dtype, power_of_two_scale=power_of_two_scale)
        return _cast(xf, scale, dtype), scale
    if granularity == "block":
        bm, bk = _check_block_size(block_size)
        return _quantize_blocks(x, dtype, bm, bk, power_of_two_scale)
    raise ValueError(f"granularity={granularity!r} is not supported; allowed: {list(GRANULARITIES)}")


def quantize_fp8_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Static scaling: quantize with a given dequant ``scale`` (e.g. calibrated), saturating.

    Values beyond ``scale * fp8_max`` clamp to ``±fp8_max`` (never NaN). ``scale`` broadcasts
    against ``x``, or is a block scale when ``block_size`` is given.
    """
    scale = scale.float()
    if block_size is not None:
        scale = expand_block_scale(scale, block_size, x.shape)
    return _cast(x.float(), scale, dtype)


def expand_block_scale(
    scale: torch.Tensor, block_size: tuple[int, int], shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """Expand a ``(..., ⌈M/bm⌉, ⌈K/bk⌉)`` block scale to ``(..., M, K)`` (elementwise scale)."""
    bm, bk = _check_block_size(block_size)
    m, k = shape[-2:]
    if scale.shape[-2:] != (-(-m // bm), -(-k // bk)):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match shape {tuple(shape)} with block_size "
            f"{(bm, bk)}: expected trailing dims {(-(-m // bm), -(-k // bk))}"
        )
    full = scale.repeat_interleave(bm, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :m, :k]


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q * scale`` in float32, cast to ``dtype``.

    Tensorwise and rowwise scales broadcast; block scales need the ``block_size`` they were made with.
    """
    qf = q.float()
    if block_size is not None:
        return (qf * expand_block_scale(scale.float(), block_size, q.shape)).to(dtype)
    try:
        torch.broadcast_shapes(q.shape, scale.shape)
    except RuntimeError:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not broadcast to q shape {tuple(q.shape)}; "
            "pass block_size=(bm, bk) for block scales"
        ) from None
    return (qf * scale.float()).to(dtype)
