"""lumenrl-quant: low-precision library for RL, depends on torch only.

FP8 / MXFP8 / MXFP4 formats and quantization, scaled GEMM, quantized linear layers and model
quantization for rollout, a fused MoE experts kernel (bf16 / FP8 weights), FP8 KV cache with scale calibration, FP8 training, TIS/MIS rollout
correction. See the package README for examples.

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_quant`` and
its torch-free :mod:`lumenrl_quant.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lumenrl_quant.__about__ import __version__

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "training": (
        "Fp8ConversionReport", "Fp8TrainingConfig", "Fp8TrainingLinear", "attach_weight_cache_invalidation",
        "convert_to_fp8_training", "invalidate_fp8_weight_caches",
    ),
    "correction": (
        "MISGeometric", "MISSequence", "MISToken", "SeqMIS", "TISSequence", "TISToken", "apply_is_weights",
        "kl_rejection_mask", "mis_geometric_mask", "mis_sequence_mask", "mis_token_mask",
        "rollout_correction_metrics", "rollout_log_ratio", "seq_mis", "tis_sequence_weights",
        "tis_token_weights", "train_rollout_kl",
    ),
    "formats": (
        "E4M3", "E4M3FNUZ", "E5M2", "E5M2FNUZ", "FP8Dtypes", "FP8Format", "FP8_FORMATS", "fp8_dtypes_for",
        "fp8_format", "fp8_max", "is_fnuz_device",
    ),
    "schemes": (
        "Fp8Block", "Fp8Row", "Fp8W8A16", "Fp8Tensor", "MXFP4", "MXFP8", "QUANT_SCHEMES",
        "get_quant_scheme",
    ),
    "kv_cache": (
        "KVScales", "all_reduce_max_", "calibrate_kv_scales", "dequantize_kv", "percentile_amax",
        "quantize_kv",
    ),
    "linear": ("LINEAR_SCHEMES", "QuantizedLinear"),
    "mx": ("MXTensor", "dequantize_mx", "pack_fp4", "quantize_mx", "unpack_fp4"),
    "model": (
        "QuantizationReport", "ReloadReport", "find_decoder_layers", "quantize_model",
        "reload_quantized_weights_",
    ),
    "fp8": (
        "amax_to_scale", "dequantize_fp8", "expand_block_scale", "quantize_fp8", "quantize_fp8_with_scale",
    ),
    "gemm": ("emulated_scaled_mm", "gemm_path", "scaled_mm"),
    "error": ("sqnr_db",),
    "fused_norm": ("rmsnorm_quantize_fp8",),
    "fused_mlp": ("silu_mul_quantize", "swiglu_mlp_fp8", "swiglu_mlp_fp8_tokenwise"),
    "moe": (
        "FusedMoEConfig", "MoETile", "dequantize_experts_fp8", "fused_moe", "fused_moe_config", "fused_moe_reference",
        "moe_align", "quantize_experts_fp8", "triton_moe_available",
    ),
}
_MODULE_OF = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_MODULE_OF]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
