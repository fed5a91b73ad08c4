"""How the FSDP2 backend holds its weights: mixed precision, FP8 linears, HF writing.

- :func:`mixed_precision`: the FSDP2 policy (bf16 compute, fp32 gradient reduction on CUDA) that
  :func:`~lumenrl_backends.training.parallelize.parallelize` applies with ``fully_shard``.
- :func:`compute_dtype`: the forward/backward dtype of a mode on a device (bf16 on CUDA with
  ``auto``/``bf16``, else fp32); the single-device fast path uses it for its module weights.
- :func:`apply_fp8`: lumenrl-quant FP8 training linears (LM/value heads stay high precision).
- :func:`write_hf`: ``save_pretrained`` of a full state dict (a critic adds its value head).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["apply_fp8", "compute_dtype", "fp8_api", "mixed_precision", "write_hf"]

MIXED_PRECISION_MODES = ("auto", "bf16", "fp32")


def _check_mode(mode: str) -> str:
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(
            f"policy.train.mixed_precision={mode!r} is not allowed; allowed: {', '.join(MIXED_PRECISION_MODES)}"
        )
    return mode


def compute_dtype(mode: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA unless ``mode`` is fp32; fp32 on CPU."""
    if _check_mode(mode) == "fp32" or device.type != "cuda":
        return torch.float32
    return torch.bfloat16


def mixed_precision(mode: str, device: torch.device):
    """FSDP2 ``MixedPrecisionPolicy`` (bf16 params, fp32 reduce) or None for fp32 compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype(mode, device) == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


HIGH_PRECISION_HEADS = ("lm_head", "value_head")  # kept out of FP8: log-probs/values stay accurate


def fp8_api():
    """``(convert_to_fp8_training, attach_weight_cache_invalidation)`` from lumenrl-quant, lazily."""
    try:
        from lumenrl_quant.training import attach_weight_cache_invalidation, convert_to_fp8_training
    except ImportError as exc:
        raise RuntimeError(
            "quantization.training.precision='fp8' needs lumenrl_quant.convert_to_fp8_training, "
            f"which the installed lumenrl-quant does not provide ({exc}); use precision 'bf16' or upgrade it"
        ) from exc
    return convert_to_fp8_training, attach_weight_cache_invalidation


def apply_fp8(model: nn.Module, fp8: Any) -> Any | None:
    """Swap eligible linears (not the heads) for FP8 training linears; returns the quant report."""
    if fp8 is None or fp8.precision in ("bf16", "fp32"):
        return None
    if fp8.precision != "fp8":
        raise ValueError(
            f"quantization.training.precision={fp8.precision!r} is not supported by the fsdp2 backend; "
            "allowed: bf16, fp32, fp8"
        )
    convert, _ = fp8_api()
    report = convert(
        model,
        recipe=fp8.recipe,
        fp8_format=fp8.fp8_format,
        weight_cache=fp8.weight_cache,
        module_filter=lambda fqn, _module: fqn.rpartition(".")[2] not in HIGH_PRECISION_HEADS,
    )
    if not report.converted:
        raise ValueError(
            f"quantization.training.precision='fp8' (recipe={fp8.recipe!r}) converted no layer of "
            f"{type(model).__name__}: {report}"
        )
    return report


def write_hf(model: nn.Module, state: dict[str, torch.Tensor], path: str, *, critic: bool) -> None:
    """``save_pretrained`` with ``state``; config.json names the dtype of ``state`` (the fp32 master),
    not that of the module's parameters (bf16 compute weights on the single-device path)."""
    hf = model.model if critic else model
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)  # save_pretrained may pop
    if critic:
        from safetensors.torch import save_file

        backbone = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
        hf.save_pretrained(path, state_dict=backbone)
        head = {k: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
        save_file(head, f"{path}/value_head.safetensors")
    else:
        model.save_pretrained(path, state_dict=state)
    if dtype is not None and str(hf.config.dtype).rpartition(".")[2] != str(dtype).rpartition(".")[2]:
        hf.config.dtype = dtype
        hf.config.save_pretrained(path)
