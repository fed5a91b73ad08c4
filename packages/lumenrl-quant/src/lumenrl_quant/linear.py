"""Quantized linear layer for rollout (inference), with in-place requantization on weight sync.

Design
------
:class:`QuantizedLinear` replaces an ``nn.Linear`` (weight ``(N, K)``) at inference. Schemes:

============  ===============================  ===================================  ==================
scheme        weight buffers                   activations (dynamic, per call)      matmul
============  ===============================  ===================================  ==================
fp8_block     fp8 ``(N, K)``, fp32 128x128     fp8, 1x128 per-token-group scales    ``scaled_mm``
              block scales ``(⌈N/128⌉, ⌈K/128⌉)``
fp8_row       fp8, fp32 ``(N, 1)`` per channel  fp8, per-token ``(M, 1)``             ``scaled_mm``
fp8_tensor    fp8, fp32 ``()``                  fp8, one scale per call               ``scaled_mm``
mxfp8         fp8 e4m3, E8M0 uint8 ``(N, ⌈K/32⌉)``  MXFP8 e4m3 (quantize-dequantize)   emulated (dequantize)
mxfp4         packed uint8 ``(N, ⌈K/2⌉)``, E8M0  unquantized (weight-only)            emulated (dequantize)
============  ===============================  ===================================  ==================

Scales are dequant scales (``x ≈ q * scale``, see :mod:`lumenrl_quant.fp8`). The quantized
weight is the buffer ``weight`` and its scale ``weight_scale``, so state-dict names match the
original model's. :meth:`QuantizedLinear.reload_` requantizes a new high-precision weight
*into the existing buffers* (``copy_``, same storage and ``data_ptr``), which keeps CUDA graphs
and engine-held pointers valid across weight syncs. FP8 math follows :func:`scaled_mm`'s path
choice; MX matmuls dequantize to the activation dtype (no MX tensor cores on Hopper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_quant.formats import fp8_dtypes_for, fp8_format
from lumenrl_quant.fp8 import dequantize_fp8, quantize_fp8
from lumenrl_quant.gemm import scaled_mm
from lumenrl_quant.mx import MXTensor, dequantize_mx, quantize_mx

__all__ = ["LINEAR_SCHEMES", "QuantizedLinear"]

# scheme -> (weight granularity, weight block, activation granularity, activation block)
_FP8_LAYOUTS: dict[str, tuple[str, tuple[int, int] | None, str, tuple[int, int] | None]] = {
    "fp8_block": ("block", (128, 128), "block", (1, 128)),
    "fp8_row": ("rowwise", None, "rowwise", None),
    "fp8_tensor": ("tensorwise", None, "tensorwise", None),
}
_MX_ELEMS = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
LINEAR_SCHEMES: tuple[str, ...] = (*_FP8_LAYOUTS, *_MX_ELEMS)


def _scheme_name(scheme: object) -> str:
    name = scheme if isinstance(scheme, str) else getattr(scheme, "name", None)
    if name not in LINEAR_SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not a linear quantization scheme; allowed: {list(LINEAR_SCHEMES)}")
    return name


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored quantized (see module doc for the schemes)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        scheme: str = "fp8_block",
        bias: bool = True,
        fp8_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight: torch.Tensor | None = None,
    ) -> None:
        """``weight``: the high-precision ``(N, K)`` weight to start from (zeros when None)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = _scheme_name(scheme)
        self.fp8_dtype = fp8_dtype if fp8_dtype is not None else fp8_dtypes_for(device).e4m3
        fp8_format(self.fp8_dtype)  # validates
        if weight is None:
            weight = torch.zeros(out_features, in_features, device=device)
        self._check_weight_shape(weight)
        weight, scale = self._quantize(weight.detach().to(device))
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: object = "fp8_block", *, fp8_dtype: torch.dtype | None = None
    ) -> QuantizedLinear:
        """Quantize an ``nn.Linear`` (its weight is not modified)."""
        module = cls(
            linear.in_features, linear.out_features, scheme=_scheme_name(scheme), bias=linear.bias is not None,
            fp8_dtype=fp8_dtype, device=linear.weight.device, weight=linear.weight,
        )
        if linear.bias is not None:
            module.bias.data = linear.bias.detach().clone()
        return module

    def _check_weight_shape(self, weight: torch.Tensor) -> None:
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match this layer's {expected}")

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scheme in _MX_ELEMS:
            t = quantize_mx(weight, _MX_ELEMS[self.scheme])
            return t.data, t.scale
        gran, block, _, _ = _FP8_LAYOUTS[self.scheme]
        return quantize_fp8(weight, dtype=self.fp8_dtype, granularity=gran, block_size=block)

    @torch.no_grad()
    def reload_(self, weight: torch.Tensor) -> QuantizedLinear:
        """Requantize a new high-precision ``(N, K)`` weight in place into the existing buffers."""
        self._check_weight_shape(weight)
        q, scale = self._quantize(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the layer sees it, ``(N, K)`` in ``dtype``."""
        if self.scheme in _MX_ELEMS:
            shape = torch.Size((self.out_features, self.in_features))
            return dequantize_mx(MXTensor(self.weight, self.weight_scale, _MX_ELEMS[self.scheme], shape), dtype)
        return dequantize_fp8(self.weight, self.weight_scale, block_size=_FP8_LAYOUTS[self.scheme][1], dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        if self.scheme in _FP8_LAYOUTS:
            out = self._fp8_forward(x2)
        else:
            if self.scheme == "mxfp8":
                x2 = quantize_mx(x2, "e4m3").dequantize(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out = F.linear(x2, self.dequantized_weight(x.dtype), bias)
        return out.reshape(*lead, self.out_features)

    def _fp8_forward(self, x2: torch.Tensor) -> torch.Tensor:
        _, w_block, a_gran, a_block = _FP8_LAYOUTS[self.scheme]
        a_q, a_scale = quantize_fp8(x2, dtype=self.fp8_dtype, granularity=a_gran, block_size=a_block)
        return scaled_mm(
            a_q, a_scale, self.weight, self.weight_scale, out_dtype=x2.dtype, bias=self.bias,
            a_block_size=a_block, b_block_size=w_block,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"bias={self.bias is not None}")
