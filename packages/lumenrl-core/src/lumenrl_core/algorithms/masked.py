"""Masked reductions over (B, T) response tensors.

Masks are 0/1 tensors (bool, int or float) broadcastable to the values; a masked-out element
contributes nothing. Means over an empty mask are 0 (the denominator is clamped to 1), so a
micro-batch whose responses are all padding yields a zero loss instead of NaN.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; over all elements when ``dim`` is None."""
    product = values * mask.to(values.dtype)
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 where the mask is empty)."""
    count = masked_sum(torch.ones_like(values), mask, dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements; Bessel-corrected when ``unbiased`` (n - 1 divisor)."""
    mean = masked_mean(values, mask)
    sq_dev = masked_sum((values - mean) ** 2, mask)
    count = masked_sum(torch.ones_like(values), mask)
    divisor = count - 1.0 if unbiased else count
    return sq_dev / divisor.clamp_min(1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with mean and unbiased var over the masked elements.

    With ``shift_mean=False`` the mean is added back (scale-only whitening). Elements outside
    the mask are transformed too; callers multiply by the mask where zeros are needed.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean
