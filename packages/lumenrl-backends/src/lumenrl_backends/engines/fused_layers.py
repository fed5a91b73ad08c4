"""Decoder-layer fusion for the native engine: a layer's RMSNorms and residual adds folded into its GEMMs.

A transformers decoder layer (Llama, Qwen2, Qwen3, Mistral) computes ``h = x + attn(norm1(x))`` and then
``h + mlp(norm2(h))``. Under ``torch.compile`` each norm with the residual add before it is one inductor
kernel per norm: two kernels per layer that read and write the (rows, hidden) activations, each a launch and a
drain in a decode step of a few hundred kernels. Once the layer's attention and MLP are fused
(:mod:`~lumenrl_backends.engines.fusion`), :func:`layer_forward` replaces the layer's forward for engine
forwards (the engine's cache, autograd off; anything else runs the HF forward) with one of two paths:

* ``fp8_norm`` (``KernelOptions.fp8_norm_quant``, ``fp8_row`` layers): each RMSNorm hands its consumer
  per-token FP8 codes and scales directly (:func:`lumenrl_quant.rmsnorm_quantize_fp8`: one pass with two
  parallel reductions instead of the normalised row and then its amax).
* ``norm_gemm`` (``KernelOptions.fused_norm``, 16-bit layers whose four decode GEMMs run the Triton decode
  kernel): the norms run inside the GEMM after them (q/k/v, gate/up: the kernel gathers each row's sum of
  squares while it streams K and scales the sum at the end) and the residual adds in the epilogue of the GEMM
  before them (o, down: the output rounded as the unfused GEMM's, plus the residual, rounded as the unfused
  add). No norm or add kernel is left in the layer. Numerics (:func:`~lumenrl_backends.engines.triton_linear.
  reference_decode_linear`): the GEMM's operand is ``x * g`` rounded to the model dtype and the row scale
  multiplies the float32 sum, where transformers rounds ``x * rstd`` and then ``g * (.)``: one rounding of the
  input fewer, so the error against float64 is no larger (the tests bound both). Prefill-sized inputs take
  the op's torch path, which runs transformers' norm, the GEMM and the add as separate ops. Measured slower
  than the separate norm kernels (decision 0023): an experiment, off by default.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lumenrl_backends.engines.fused_storage import _FusedQuantized
from lumenrl_backends.engines.fusion import (
    _DECODE_ATTR,
    _FP8_OUT_ATTR,
    _FUSED_ATTR,
    _SUBCLASSES,
    _SWIGLU_ATTR,
    FusionReport,
    _attention_forward,
    _cache_kwarg,
    _engine_forward,
    _fused_class,
    _mlp_forward,
)

__all__ = ["DECODER_CLASSES", "LAYER_ATTR", "RMSNORM_CLASSES", "layer_forward", "set_layer_fusion"]

# decoder layers whose forward is: x + attn(norm1(x)), then + mlp(norm2(.)) (HF 5.x: returns the tensor)
DECODER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"})
RMSNORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
LAYER_ATTR = "_lumenrl_layer_mode"  # instance attribute: "fp8_norm", "norm_gemm" or None (the HF forward)


def layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The HF decoder layer with its norms fused into the GEMMs (module doc). Engine forwards only."""
    cache = cache if cache is not None else past_key_values
    mode = self.__dict__.get(LAYER_ATTR)
    if mode is None or not _engine_forward(cache):
        return self._lumenrl_original_forward(
            hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            **{self._lumenrl_layer_cache_kwarg: cache}, use_cache=use_cache, position_embeddings=position_embeddings,
            **kwargs)
    attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
    common = {"attention_mask": attention_mask, "position_ids": position_ids, "cache": cache, "use_cache": use_cache,
              "position_embeddings": position_embeddings, **kwargs}
    if mode == "norm_gemm":  # norm1 in q/k/v, + x in o; norm2 in gate/up, + h in down
        hidden_states, _ = attn(hidden_states=hidden_states, lumenrl_norm=(norm1.weight, norm1.variance_epsilon),
                                lumenrl_residual=hidden_states, **common)
        return mlp(hidden_states, lumenrl_norm=(norm2.weight, norm2.variance_epsilon), lumenrl_residual=hidden_states)
    from lumenrl_quant import rmsnorm_quantize_fp8

    residual = hidden_states
    normed = rmsnorm_quantize_fp8(hidden_states, norm1.weight, norm1.variance_epsilon,
                                  dtype=getattr(attn, _FUSED_ATTR).linear.fp8_dtype)
    hidden_states, _ = attn(hidden_states=hidden_states, lumenrl_prequantized=normed, **common)
    hidden_states = residual + hidden_states
    residual = hidden_states
    normed = rmsnorm_quantize_fp8(hidden_states, norm2.weight, norm2.variance_epsilon,
                                  dtype=getattr(mlp, _FUSED_ATTR).linear.fp8_dtype)
    return residual + mlp(hidden_states, lumenrl_prequantized=normed)


def _common_reason(layer: nn.Module) -> str | None:
    """What both paths need: a tensor-returning HF forward, fused attention and MLP, known RMSNorms."""
    if inspect.signature(type(layer)._lumenrl_original_forward if type(layer) in _SUBCLASSES.values()
                         else type(layer).forward).return_annotation not in (torch.Tensor, "torch.Tensor"):
        return "the HF layer forward does not return a tensor (older transformers)"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attn).forward is not _attention_forward or type(mlp).forward is not _mlp_forward:
        return "attention or MLP not fused"
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name, None)
        if type(norm).__name__ not in RMSNORM_CLASSES or not hasattr(norm, "variance_epsilon"):
            return f"{name} is {type(norm).__name__}, not a known RMSNorm"
    return None


def _fp8_norm_reason(layer: nn.Module) -> str | None:
    """None when the layer's norms can hand their consumers per-token FP8 input, else why not."""
    reason = _common_reason(layer)
    if reason is not None:
        return reason
    fused = layer.self_attn.__dict__.get(_FUSED_ATTR)
    if not isinstance(fused, _FusedQuantized) or fused.linear.scheme != "fp8_row":
        return "q/k/v not fp8_row"
    if layer.mlp.__dict__.get(_SWIGLU_ATTR) != "token":
        return "MLP not on the per-token FP8 path"
    return None


def _norm_gemm_reason(layer: nn.Module) -> str | None:
    """None when the layer's norms and residual adds can run inside its decode GEMMs, else why not."""
    reason = _common_reason(layer)
    if reason is not None:
        return reason
    attn, mlp = layer.self_attn, layer.mlp
    for kind, module in (("attention", attn), ("MLP", mlp)):
        decode = module.__dict__.get(_DECODE_ATTR)
        if decode is None or not (decode.first and decode.second):
            return f"the {kind}'s two GEMMs are not both on the decode kernel (decode_linear_skipped says why)"
    if attn.__dict__.get(_FP8_OUT_ATTR) is not None:
        return "attention hands o_proj FP8 codes"
    hidden = attn.o_proj.weight.shape[0]
    for name in ("input_layernorm", "post_attention_layernorm"):
        weight = getattr(layer, name).weight
        if tuple(weight.shape) != (hidden,) or weight.dtype != attn.o_proj.weight.dtype:
            return f"{name}.weight {tuple(weight.shape)} {weight.dtype}; need ({hidden},) in the GEMMs' dtype"
    return None


def set_layer_fusion(layer: nn.Module, name: str, *, fp8_norm: bool, norm_gemm: bool, report: FusionReport) -> None:
    """Choose ``layer``'s path (``fp8_norm`` first, then ``norm_gemm``, each only where asked for and possible) and
    record it in ``report``; a layer fused by an earlier engine is re-decided (off: back to the HF forward)."""
    fp8_reason = _fp8_norm_reason(layer) if fp8_norm else "off"
    gemm_reason = _norm_gemm_reason(layer) if norm_gemm and fp8_reason is not None else "off"
    mode = "fp8_norm" if fp8_reason is None else "norm_gemm" if gemm_reason is None else None
    if mode is not None and type(layer) not in _SUBCLASSES.values():
        layer.__dict__["_lumenrl_layer_cache_kwarg"] = _cache_kwarg(type(layer))
        layer.__class__ = _fused_class(type(layer), layer_forward)
    if type(layer) in _SUBCLASSES.values():
        layer.__dict__[LAYER_ATTR] = mode
    if mode == "fp8_norm":
        report.layers_fp8_norm.append(name)
    elif mode == "norm_gemm":
        report.layers_fused_norm.append(name)
    elif norm_gemm and gemm_reason != "off":
        report.layers_fused_norm_skipped[name] = gemm_reason
