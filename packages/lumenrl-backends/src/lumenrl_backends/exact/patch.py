"""Switch an HF causal LM to the batch-invariant operators (in place, per module instance).

:func:`enable_exact` rebinds, on the given model only: every ``nn.Linear``'s forward to
:func:`~lumenrl_backends.exact.ops.exact_linear`; every Llama/Qwen-style ``RMSNorm`` (including
Qwen3's q/k norms) to :func:`~lumenrl_backends.exact.ops.exact_rms_norm`; every MLP's SiLU to
:func:`~lumenrl_backends.exact.ops.exact_silu`; the rotary embedding's cos/sin to position-
independent evaluation; and the attention implementation to ``"lumenrl_exact"``
(:mod:`~lumenrl_backends.exact.attention`). Parameter names, storage and state dicts are unchanged
(weight sync, checkpoints and FSDP2 sharding see the same tensors). Families whose blocks hold
other non-invariant operators (MoE routing, MLA, softcapping, other norms) are refused.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lumenrl_backends.exact.attention import ATTN_NAME, register
from lumenrl_backends.exact.ops import exact_linear, exact_rms_norm, exact_silu, vector_safe

__all__ = ["EXACT_QUANT_SCHEMES", "SUPPORTED_FAMILIES", "check_engine_settings", "enable_exact",
           "enable_exact_quantized", "exact_actor", "is_exact"]

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return exact_linear(x, self.weight, self.bias)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return exact_rms_norm(x, self.weight, self.variance_epsilon)


class ExactSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_silu(x)


@torch.no_grad()
def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    """HF's default rotary forward (inv_freq x position in float32, cos/sin, attention scaling)."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # (B, L, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = vector_safe(torch.cos, emb) * self.attention_scaling
    sin = vector_safe(torch.sin, emb) * self.attention_scaling
    return cos.to(x.dtype), sin.to(x.dtype)


def model_type_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def enable_exact(
    model: nn.Module,
    engine_settings: tuple[Any, Any, str] | None = None,
    trainer_settings: tuple[Any, Any] | None = None,
) -> nn.Module:
    """Rebind ``model``'s operators to the batch-invariant ones (idempotent); returns ``model``.
    Checked first: ``engine_settings``, the native engine's (quant_scheme, kv_cache_dtype, compile);
    ``trainer_settings``, the training backend's (FP8 report, compile_layers)."""
    if engine_settings is not None:
        check_engine_settings(*engine_settings)
    if trainer_settings is not None:
        fp8_report, compile_layers = trainer_settings
        if fp8_report is not None:
            raise ValueError("policy.rollout.exact_logprobs=true needs full-precision training linears; "
                             "quantization.training FP8/MX GEMMs are not batch invariant")
        if compile_layers:
            raise ValueError("policy.train.compile_layers cannot be combined with policy.rollout.exact_logprobs=true "
                             "(the batch-invariant kernels run eagerly)")
    family = model_type_of(model)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"exact log-probs (policy.rollout.exact_logprobs) support the families {', '.join(SUPPORTED_FAMILIES)}; "
            f"this model is {family!r}"
        )
    if getattr(model, "_lumenrl_exact", False):
        return model
    register()
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
        elif name in _NORMS:
            module.forward = types.MethodType(_norm_forward, module)
        elif name.endswith("RotaryEmbedding"):
            if getattr(module, "rope_type", "default") not in ("default", "llama3", "linear", "dynamic"):
                raise ValueError(f"exact log-probs: rope type {module.rope_type!r} is not supported")
            module.forward = types.MethodType(_rotary_forward, module)
        elif hasattr(module, "act_fn") and hasattr(module, "down_proj"):
            act = getattr(model.config, "hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"exact log-probs: activation {act!r} is not supported (SiLU only)")
            module.act_fn = ExactSiLU()
    _set_attention(model)
    model._lumenrl_exact = True
    return model


def _set_attention(model: nn.Module) -> None:
    if getattr(model.config, "attention_dropout", 0.0):
        raise ValueError("exact log-probs need attention_dropout=0")
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTN_NAME


def is_exact(model: Any) -> bool:
    return bool(getattr(model, "_lumenrl_exact", False))


# rollout schemes whose rounding of a token depends on that token only (fp8_tensor: one scale per call)
EXACT_QUANT_SCHEMES = ("fp8_block", "fp8_row", "fp8_w8a16", "mxfp8", "mxfp4")


def check_engine_settings(quant_scheme: Any, kv_cache_dtype: Any, compile: str) -> None:
    """The native engine's exact mode: a KV cache in the model dtype, no torch.compile (CUDA graphs stay
    on); the engine also turns projection fusion off (the HF modules as the trainer runs them). With
    rollout weights in FP8/MX (:func:`enable_exact_quantized`) the engine's log-probs equal a forward of its
    own quantized model bit for bit, not the full-precision trainer's: run configs refuse that
    combination (``policy.rollout.exact_logprobs`` promises the trainer's numbers)."""
    name = getattr(quant_scheme, "name", quant_scheme)
    if quant_scheme and name not in EXACT_QUANT_SCHEMES:
        raise ValueError(f"exact_logprobs=True with quant_scheme={name!r}: its activation scale is shared by every "
                         f"token of a call, so a token's numbers depend on its batch; allowed: "
                         f"{', '.join(EXACT_QUANT_SCHEMES)} or none")
    if kv_cache_dtype not in (None, "auto"):
        raise ValueError(f"exact_logprobs=True needs the KV cache in the model dtype; kv_cache_dtype={kv_cache_dtype!r}")
    if compile != "none":
        raise ValueError(f"exact_logprobs=True runs the batch-invariant kernels eagerly; compile={compile!r} is not "
                         "supported (use 'none'; CUDA graphs stay on)")


def _quantized_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A lumenrl-quant ``QuantizedLinear`` in exact mode: the scheme's rounding of the activations (per token
    or token group), then the batch-invariant GEMM against the dequantized weight."""
    x2 = self.rounded_input(x.reshape(-1, self.in_features))
    return exact_linear(x2, self.dequantized_weight(x.dtype), self.bias).reshape(*x.shape[:-1], self.out_features)


def enable_exact_quantized(model: nn.Module) -> int:
    """Rebind the forward of every ``QuantizedLinear`` of an exact-mode ``model`` (after the engine quantized
    it) to :func:`_quantized_forward`; returns how many. Slower than the scheme's fused GEMMs (the weight is
    dequantized per call): a mode for agreement, not speed."""
    from lumenrl_quant import QuantizedLinear

    if not is_exact(model):
        raise ValueError("enable_exact_quantized: call enable_exact(model) first")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for module in layers:
        if module.scheme not in EXACT_QUANT_SCHEMES:
            raise ValueError(f"exact mode: layer scheme {module.scheme!r}; allowed: {', '.join(EXACT_QUANT_SCHEMES)}")
        module.forward = types.MethodType(_quantized_forward, module)
    return len(layers)


def exact_actor(model: nn.Module, enabled: bool, fp8_report: Any, compile_layers: Any) -> bool:
    """The training backend's switch: ``enabled`` (exact mode and the actor role) rebinds ``model`` to the
    engine's batch-invariant operators, refusing FP8/MX training linears and compiled layers; returns it."""
    if enabled:
        enable_exact(model, trainer_settings=(fp8_report, compile_layers))
    return enabled
