"""The fused storage behind the engine's projection fusion (:mod:`~lumenrl_backends.engines.fusion`).

q/k/v (and gate/up) become one linear over the concatenation of the members' weights; each member's
parameters become views of that storage (so a weight sync writes through to it, and training still sees the
original modules). Dense members fuse into one ``F.linear``; lumenrl-quant ``QuantizedLinear`` members of one
scheme fuse into one ``QuantizedLinear`` whose buffers the members' buffers view. A group that cannot fuse
(different dtypes, devices, schemes, scale layouts) gets the reason instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__: list[str] = []  # internal to the engine: fusion.py re-exports what it uses


class _FusedDense:
    """``F.linear`` over the concatenated weight, split into the members' outputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight, self.bias, self.sizes = weight, bias, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class _FusedQuantized:
    """A fused ``QuantizedLinear`` (not registered as a submodule), split into the members' outputs."""

    def __init__(self, linear: nn.Module, sizes: list[int]) -> None:
        self.linear, self.sizes = linear, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


def _view_parameter(module: nn.Module, name: str, view: torch.Tensor, old: nn.Parameter) -> None:
    setattr(module, name, nn.Parameter(view, requires_grad=old.requires_grad))


def _fuse_dense(linears: list[nn.Linear]) -> _FusedDense | str:
    first = linears[0].weight
    if any(type(m) is not nn.Linear for m in linears):
        return "not all plain nn.Linear"
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device or m.in_features != linears[0].in_features
           for m in linears):
        return "members differ in dtype, device or in_features"
    has_bias = {m.bias is not None for m in linears}
    if len(has_bias) != 1:
        return "some members have a bias and some do not"
    sizes = [m.out_features for m in linears]
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
        bias = torch.cat([m.bias.detach() for m in linears]).contiguous() if has_bias == {True} else None
    start = 0
    for m, size in zip(linears, sizes):
        _view_parameter(m, "weight", weight[start : start + size], m.weight)
        if bias is not None:
            _view_parameter(m, "bias", bias[start : start + size], m.bias)
        start += size
    return _FusedDense(weight, bias, sizes)


def _scale_rows(linear: nn.Module) -> int | None:
    """Weight rows per scale row, or None when the scale is not row-aligned.

    Block schemes (``fp8_block``: 128x128 weight blocks) are row-aligned only when ``out_features``
    is a whole number of blocks: a partial last block would not line up with the next member's
    first one in the fused layer (whose scale rows are ``ceil(sum N / 128)``). Per-tensor scales
    (``fp8_tensor``) are never row-aligned."""
    from lumenrl_quant.linear import _FP8_LAYOUTS

    scale, rows = linear.weight_scale, linear.out_features
    block = _FP8_LAYOUTS.get(linear.scheme, (None, None))[1]
    if block is not None:
        return block[0] if rows % block[0] == 0 and scale.dim() and scale.shape[0] == rows // block[0] else None
    if scale.dim() == 0 or scale.shape[0] == 0 or rows % scale.shape[0]:
        return None
    return rows // scale.shape[0]


def _fuse_quantized(linears: list[nn.Module]) -> _FusedQuantized | str:
    from lumenrl_quant import QuantizedLinear

    if any(type(m) is not QuantizedLinear for m in linears):
        return "not all QuantizedLinear of the same kind"
    first = linears[0]
    if any(m.scheme != first.scheme or m.fp8_dtype != first.fp8_dtype or m.in_features != first.in_features
           or m.weight.dtype != first.weight.dtype or m.weight_scale.dtype != first.weight_scale.dtype
           or m.weight.shape[1:] != first.weight.shape[1:] or m.weight_scale.shape[1:] != first.weight_scale.shape[1:]
           for m in linears):
        return "quantized members differ in scheme, dtype or layout"
    rows = {_scale_rows(m) for m in linears}
    if None in rows or len(rows) != 1 or any(m.weight.shape[0] != m.out_features for m in linears):
        return f"scheme {first.scheme!r}: scales are not row-aligned across the members"
    if len({m.bias is not None for m in linears}) != 1:
        return "some members have a bias and some do not"
    sizes = [m.out_features for m in linears]
    device = first.weight.device
    fused = QuantizedLinear(first.in_features, sum(sizes), scheme=first.scheme, bias=first.bias is not None,
                            fp8_dtype=first.fp8_dtype, device=device,
                            weight=torch.zeros(sum(sizes), first.in_features, device=device))
    with torch.no_grad():
        fused.weight = torch.cat([m.weight for m in linears]).contiguous()
        fused.weight_scale = torch.cat([m.weight_scale for m in linears]).contiguous()
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]).contiguous(), requires_grad=False)
    start, scale_start = 0, 0
    for m, size in zip(linears, sizes):
        scale_size = m.weight_scale.shape[0]
        m.weight = fused.weight[start : start + size]
        m.weight_scale = fused.weight_scale[scale_start : scale_start + scale_size]
        if m.bias is not None:
            _view_parameter(m, "bias", fused.bias[start : start + size], m.bias)
        start, scale_start = start + size, scale_start + scale_size
    for module in (fused, *linears):  # GEMM paths chosen from the (new) buffers, where the layer has them
        if hasattr(module, "_select_paths"):
            module._select_paths()
    return _FusedQuantized(fused, sizes)


def _fuse_group(linears: list[nn.Module]) -> _FusedDense | _FusedQuantized | str:
    if all(hasattr(m, "reload_") and hasattr(m, "weight_scale") for m in linears):
        return _fuse_quantized(linears)
    return _fuse_dense(linears)
