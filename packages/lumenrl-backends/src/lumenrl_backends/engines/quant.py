"""Low-precision rollout for the native engine, through lumenrl-quant.

* Weights: ``quantization.rollout.precision`` fp8 / mxfp8 / mxfp4 picks a lumenrl-quant scheme
  (``quantization.rollout.scheme`` overrides; default ``fp8_block``, ``mxfp8``, ``mxfp4``), whose
  ``quantize_model`` swaps the decoder linears for ``QuantizedLinear`` in place (embeddings,
  norms and MoE routers stay high precision; ``lm_head`` too unless ``quantize_lm_head``). Weight
  sync requantizes in place (see :mod:`~lumenrl_backends.engines.weights`).
* KV cache: ``kv_cache_dtype="fp8"`` stores K/V as FP8 E4M3 with one static scale per layer and
  tensor (K, V), computed as ``percentile_99.9(|x|) * 1.05 / fp8_max`` from the first prefill
  after construction and after every weight update (the policy moves every step, so scales are
  recalibrated per sync). Attention runs on dequantized values (an emulation: fast FP8
  attention kernels are GPU work).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PRECISION_SCHEMES", "rollout_scheme", "quantize_rollout_model", "kv_cache_dtype", "FP8KVCodec",
           "norm_quant_pays", "set_quantized_pdl"]

PRECISION_SCHEMES = {"fp8": "fp8_block", "mxfp8": "mxfp8", "mxfp4": "mxfp4"}


def rollout_scheme(rollout_quant: Any) -> Any | None:
    """A lumenrl-quant scheme object for ``quantization.rollout``, or None for bf16/fp16/fp32."""
    precision = rollout_quant.precision
    if precision not in PRECISION_SCHEMES:
        return None
    from lumenrl_quant import get_quant_scheme

    name = rollout_quant.scheme or PRECISION_SCHEMES[precision]
    return get_quant_scheme(
        name,
        skip_first_n_layers=rollout_quant.skip_first_n_layers,
        skip_last_n_layers=rollout_quant.skip_last_n_layers,
        quantize_lm_head=getattr(rollout_quant, "quantize_lm_head", False),
    )


def quantize_rollout_model(model: nn.Module, scheme: Any) -> Any:
    """Quantize ``model`` in place with a scheme object or name; returns lumenrl-quant's report."""
    if isinstance(scheme, str):
        from lumenrl_quant import get_quant_scheme

        scheme = get_quant_scheme(scheme)
    return scheme.quantize_model(model)


def norm_quant_pays(compile: str, device: torch.device) -> bool:
    """RMSNorm + quantize in one pass (``fp8_norm_quant``) is one inductor kernel under ``compile="full"``;
    run eagerly on a GPU it is a dozen small torch kernels, more than the HF norm plus the Triton quantize
    kernel it replaces, so CUDA engines without compile keep the two-step form. CPU engines use it (same
    numerics as the compiled GPU engine; no launch cost to speak of)."""
    return compile == "full" or device.type != "cuda"


def set_quantized_pdl(model: nn.Module, pdl: bool, prefetch: int | tuple[int | None, int | None] | None = None, *,
                      tma: bool = False) -> int:
    """Set lumenrl-quant's ``QuantizedLinear.pdl`` (its Triton rowwise decode GEMM launches with programmatic
    dependent launch) on every quantized linear of ``model``, the fused q/k/v and gate/up ones included
    (held by their modules, not registered as submodules), and, unless None, ``pdl_prefetch`` (bytes of each
    weight row prefetched to L2 before the wait; a pair: for the GEMMs after a norm, and for ``o_proj`` and
    ``down_proj``, which follow attention and gate/up), and ``tma`` (its tiles copied by the tensor memory
    accelerator); returns how many were set."""
    from lumenrl_backends.engines.fusion import _FUSED_ATTR
    from lumenrl_quant import QuantizedLinear

    first, second = prefetch if isinstance(prefetch, tuple) else (prefetch, prefetch)
    count = 0
    for name, module in model.named_modules():
        for linear in (module, getattr(module.__dict__.get(_FUSED_ATTR), "linear", None)):
            if isinstance(linear, QuantizedLinear):
                linear.pdl = bool(pdl)
                linear.tma = bool(tma)
                after_long = linear is module and name.rsplit(".", 1)[-1] in ("o_proj", "down_proj")
                if (second if after_long else first) is not None:
                    linear.pdl_prefetch = int(second if after_long else first)
                count += 1
    return count


def kv_cache_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """``auto``/None -> None (model dtype); ``fp8`` -> the device's FP8 E4M3 dtype."""
    if name in (None, "auto"):
        return None
    if isinstance(name, torch.dtype):
        return name
    if name == "fp8":
        from lumenrl_quant import fp8_dtypes_for

        return fp8_dtypes_for(device).e4m3
    raise ValueError(f"kv_cache_dtype={name!r} is not supported; choose auto or fp8")


class FP8KVCodec:
    """Per-layer static K/V scales: calibrate, quantize on write, dequantize on read."""

    def __init__(self, dtype: torch.dtype, percentile: float = 99.9, margin: float = 1.05) -> None:
        self.dtype, self.percentile, self.margin = dtype, percentile, margin
        self.scales: Any = None

    def calibrate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        from lumenrl_quant import calibrate_kv_scales

        fresh = calibrate_kv_scales(keys, values, percentile=self.percentile, margin=self.margin, dtype=self.dtype)
        if self.scales is None:
            self.scales = fresh
            return
        with torch.no_grad():  # in place: CUDA graphs captured on these scale tensors stay valid
            self.scales.k_scale.copy_(fresh.k_scale)
            self.scales.v_scale.copy_(fresh.v_scale)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from lumenrl_quant import quantize_kv

        return quantize_kv(keys, values, self.scales)

    def decode(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        from lumenrl_quant import dequantize_kv

        return dequantize_kv(keys, values, self.scales, dtype=dtype)
