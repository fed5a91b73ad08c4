"""Rollout quantization schemes as plugins (entry-point group ``lumenrl.quant_schemes``).

Each scheme is a small keyword-constructed config class (``Fp8Block(skip_first_n_layers=1)``)
that quantizes a model for rollout and requantizes it on weight sync. Class attributes: ``name``,
``capabilities`` (``fp8_weights`` or ``mx_weights``, plus what else the scheme does) and
``probe()``: ``None`` everywhere, because every scheme has an exact emulation path on any device.
Capabilities and probe come from the scheme's spec in :mod:`lumenrl_quant.plugin_manifest`, which
is what the LumenRL registry reads. Whether a *fast* path exists on a device is a separate question,
answered by :meth:`fast_path` (e.g. ``"scaled_mm_blockwise"`` on H100/H200, ``"emulated"`` on CPU
and for the MX schemes on GPUs without MX tensor cores).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lumenrl_quant import plugin_manifest as manifest
from lumenrl_quant.fp8 import quantize_fp8
from lumenrl_quant.gemm import gemm_path
from lumenrl_quant.linear import _FP8_LAYOUTS, _check_fp8_dtype
from lumenrl_quant.model import QuantizationReport, ReloadReport, quantize_model, reload_quantized_weights_

__all__ = ["QUANT_SCHEMES", "Fp8Block", "Fp8Row", "Fp8Tensor", "Fp8W8A16", "MXFP4", "MXFP8", "get_quant_scheme"]

def _fp8_fast_path(name: str, device: torch.device) -> str:
    """The GEMM path of a small probe GEMM laid out as scheme ``name``'s QuantizedLinear does it."""
    b_gran, b_block, a_gran, a_block = _FP8_LAYOUTS[name]
    if a_gran is None:  # weight-only: the decode path of a 16-row bf16 probe
        from lumenrl_quant.linear import _w8a16_ok

        probe = torch.empty((128, 128), dtype=torch.float8_e4m3fn, device=device)
        return "triton_w8a16" if _w8a16_ok(probe, torch.bfloat16, 16) else "emulated"
    a_q, a_s = quantize_fp8(torch.ones(16, 128, device=device), granularity=a_gran, block_size=a_block)
    b_q, b_s = quantize_fp8(torch.ones(128, 128, device=device), granularity=b_gran, block_size=b_block)
    return gemm_path(a_q, a_s, b_q, b_s, out_dtype=torch.bfloat16, a_block_size=a_block, b_block_size=b_block)


@dataclass(kw_only=True, slots=True)
class _RolloutScheme:
    """Shared fields of every scheme.

    skip_first_n_layers / skip_last_n_layers: decoder layers kept in high precision at each end.
    skip_modules: module names (dotted component or full name) never quantized.
    fp8_dtype: FP8 element dtype override (default: E4M3, fnuz on MI300); FP8 schemes only (MX refuses one).
    quantize_lm_head: also quantize the (untied) output head; off by default (logit accuracy).
    """

    name: ClassVar[str] = ""
    plugin_spec: ClassVar[manifest.Spec]  # each scheme's spec in lumenrl_quant.plugin_manifest
    capabilities: ClassVar[frozenset[str]] = frozenset()
    skip_first_n_layers: int = 0
    skip_last_n_layers: int = 0
    skip_modules: tuple[str, ...] = ("lm_head",)
    fp8_dtype: torch.dtype | None = None
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        _check_fp8_dtype(self.name, self.fp8_dtype)

    @classmethod
    def probe(cls) -> str | None:
        """Always runnable: the emulation path works on every device torch supports."""
        return cls.plugin_spec.unavailable_reason()

    @classmethod
    def fast_path(cls, device: torch.device | str | None = None) -> str:
        """The GEMM path this scheme gets on ``device`` (``"emulated"`` when there is no fast one)."""
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        return _fp8_fast_path(cls.name, device) if cls.name in _FP8_LAYOUTS else "emulated"

    @classmethod
    def has_fast_path(cls, device: torch.device | str | None = None) -> bool:
        return cls.fast_path(device) != "emulated"

    def quantize_model(self, model: nn.Module) -> QuantizationReport:
        """Swap the model's decoder linears in place (see :func:`lumenrl_quant.quantize_model`)."""
        return quantize_model(
            model, self.name, skip_first_n_layers=self.skip_first_n_layers,
            skip_last_n_layers=self.skip_last_n_layers, skip_modules=self.skip_modules, fp8_dtype=self.fp8_dtype,
            quantize_lm_head=self.quantize_lm_head,
        )

    def reload_weights_(
        self, model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> ReloadReport:
        """Requantize synced high-precision weights in place."""
        return reload_quantized_weights_(model, named_tensors)


@dataclass(kw_only=True, slots=True)
class Fp8Block(_RolloutScheme):
    """W8A8 FP8, 128x128 weight blocks and dynamic 1x128 activation groups (DeepSeek-V3 style)."""

    name: ClassVar[str] = "fp8_block"
    plugin_spec: ClassVar[manifest.Spec] = manifest.FP8_BLOCK
    capabilities: ClassVar[frozenset[str]] = manifest.FP8_BLOCK.capabilities


@dataclass(kw_only=True, slots=True)
class Fp8Row(_RolloutScheme):
    """W8A8 FP8, per-output-channel weight scales and dynamic per-token activation scales.

    The decode-oriented scheme: at M <= 256 the GEMM is cuBLAS tensorwise (unit scales, float32
    out) plus a scale epilogue (``scaled_mm_rowwise_epilogue``), and under ``torch.compile`` the
    per-token activation quantization fuses into the producer of the activation.
    """

    name: ClassVar[str] = "fp8_row"
    plugin_spec: ClassVar[manifest.Spec] = manifest.FP8_ROW
    capabilities: ClassVar[frozenset[str]] = manifest.FP8_ROW.capabilities


@dataclass(kw_only=True, slots=True)
class Fp8W8A16(_RolloutScheme):
    """W8A16 FP8: per-output-channel weight scales (as ``fp8_row``), activations kept 16-bit.

    No per-call activation quantization (and none of its rounding): at decode M the Triton kernel
    widens the FP8 weight tile in registers (``triton_w8a16``); prefill dequantizes the weight and
    runs the 16-bit GEMM. Half the weight bytes of bf16, like the W8A8 schemes.
    """

    name: ClassVar[str] = "fp8_w8a16"
    plugin_spec: ClassVar[manifest.Spec] = manifest.FP8_W8A16
    capabilities: ClassVar[frozenset[str]] = manifest.FP8_W8A16.capabilities


@dataclass(kw_only=True, slots=True)
class Fp8Tensor(_RolloutScheme):
    """W8A8 FP8, one weight scale and one dynamic activation scale per call."""

    name: ClassVar[str] = "fp8_tensor"
    plugin_spec: ClassVar[manifest.Spec] = manifest.FP8_TENSOR
    capabilities: ClassVar[frozenset[str]] = manifest.FP8_TENSOR.capabilities


@dataclass(kw_only=True, slots=True)
class MXFP8(_RolloutScheme):
    """OCP MXFP8 (E4M3 elements, 32-element E8M0 scales) for weights and activations; emulated matmul."""

    name: ClassVar[str] = "mxfp8"
    plugin_spec: ClassVar[manifest.Spec] = manifest.MXFP8
    capabilities: ClassVar[frozenset[str]] = manifest.MXFP8.capabilities


@dataclass(kw_only=True, slots=True)
class MXFP4(_RolloutScheme):
    """OCP MXFP4 (E2M1 elements packed two per byte) weight-only; emulated matmul."""

    name: ClassVar[str] = "mxfp4"
    plugin_spec: ClassVar[manifest.Spec] = manifest.MXFP4
    capabilities: ClassVar[frozenset[str]] = manifest.MXFP4.capabilities


QUANT_SCHEMES: dict[str, type[_RolloutScheme]] = {
    c.name: c for c in (Fp8Block, Fp8Row, Fp8Tensor, Fp8W8A16, MXFP8, MXFP4)
}


def get_quant_scheme(name: str, **kwargs: object) -> _RolloutScheme:
    """Build a scheme by name with keyword config, e.g. ``get_quant_scheme("fp8_block", skip_last_n_layers=1)``."""
    if name not in QUANT_SCHEMES:
        raise ValueError(f"quant scheme {name!r} is unknown; allowed: {sorted(QUANT_SCHEMES)}")
    return QUANT_SCHEMES[name](**kwargs)
