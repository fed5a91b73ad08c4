"""Quantization error as one number: SQNR in dB, the figure the tests and benchmarks report.

    sqnr_db(ref, approx) = 20 * log10(||ref|| / ||ref - approx||)      (Frobenius norms, float64)

Higher is better: each bit of mantissa is worth about 6 dB (E4M3, 3 bits: ~25-30 dB on Gaussian
data; E5M2: ~20 dB; E2M1: ~12-17 dB). An exact ``approx`` gives ``inf``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr_db"]


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``ref`` (same shape), in dB."""
    if ref.shape != approx.shape:
        raise ValueError(f"ref shape {tuple(ref.shape)} != approx shape {tuple(approx.shape)}")
    ref64 = ref.detach().double()
    noise = (ref64 - approx.detach().double().to(ref64.device)).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref64.norm().item() / noise)
