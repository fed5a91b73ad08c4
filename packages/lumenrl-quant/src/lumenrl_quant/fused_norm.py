"""RMSNorm straight to per-token FP8: the input of an ``fp8_row`` layer without a normalised copy.

``y = w * x / rms(x)`` followed by per-token quantization (``scale = amax(y) / fp8_max``, ``codes =
y / scale``) is two dependent reductions per row: the mean square, then the amax of the normalised
row. The row's ``1 / rms`` is a positive per-row factor, so it cancels out of the codes:

    amax(y) = amax(x * w) / rms(x),   codes = (x * w) / (amax(x * w) / fp8_max),
    scale = amax(x * w) / fp8_max / rms(x)

Both reductions (``sum(x^2)`` and ``amax(|x * w|)``) then read the same row at once, and the codes
need no division by ``rms``. Under ``torch.compile`` these plain torch ops become one kernel with two
parallel reductions (the engine's RMSNorm + quantize kernels had them in sequence). The numbers are those of quantizing the
float32 normalised row (no intermediate rounding to the activation dtype, which the HF module does
before the weight multiply), up to float32 rounding.
"""

from __future__ import annotations

import torch

from lumenrl_quant.formats import fp8_max

__all__ = ["rmsnorm_quantize_fp8", "rmsnorm_quantize_reference"]


def rmsnorm_quantize_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., K), RMSNorm ``weight`` (K,) -> ``(codes (..., K), scales (..., 1))`` with
    ``codes * scales ≈ weight * x / sqrt(mean(x^2) + eps)`` (see the module doc)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    if not eps >= 0:
        raise ValueError(f"eps={eps!r}; allowed: a float >= 0")
    limit = fp8_max(dtype)
    xf = x.float()
    xw = xf * weight.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    amax = xw.abs().amax(-1, keepdim=True)
    base = torch.where(amax > 0, amax / torch.full_like(amax, limit), torch.ones_like(amax))
    codes = (xw / base).clamp(-limit, limit).to(dtype)
    return codes, torch.where(amax > 0, base * rstd, torch.ones_like(amax))


def rmsnorm_quantize_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-step form (normalise in float32, then per-token quantize), for tests."""
    from lumenrl_quant.fp8 import quantize_fp8

    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return quantize_fp8(y, dtype=dtype, granularity="rowwise", backend="torch")
