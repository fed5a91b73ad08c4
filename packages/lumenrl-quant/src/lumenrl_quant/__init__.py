"""lumenrl-quant: low-precision library for RL, depends on torch only.

FP8 / MXFP8 / MXFP4 formats and quantization, scaled GEMM, quantized linear layers and model
quantization for rollout, a fused MoE experts kernel (bf16 / FP8 weights), FP8 KV cache with scale calibration, FP8 training, TIS/MIS rollout
correction. See the package README for examples.
"""

from lumenrl_quant.__about__ import __version__
from lumenrl_quant.correction import (
    MISGeometric,
    MISSequence,
    MISToken,
    SeqMIS,
    TISSequence,
    TISToken,
    apply_is_weights,
    kl_rejection_mask,
    mis_geometric_mask,
    mis_sequence_mask,
    mis_token_mask,
    rollout_correction_metrics,
    rollout_log_ratio,
    seq_mis,
    tis_sequence_weights,
    tis_token_weights,
)
from lumenrl_quant.error import sqnr_db
from lumenrl_quant.formats import (
    E4M3,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    FP8_FORMATS,
    FP8Dtypes,
    FP8Format,
    fp8_dtypes_for,
    fp8_format,
    fp8_max,
    is_fnuz_device,
)
from lumenrl_quant.fp8 import (
    amax_to_scale,
    dequantize_fp8,
    expand_block_scale,
    quantize_fp8,
    quantize_fp8_with_scale,
)
from lumenrl_quant.fused_mlp import silu_mul_quantize, swiglu_mlp_fp8, swiglu_mlp_fp8_tokenwise
from lumenrl_quant.fused_moe import (
    FusedMoEConfig,
    MoETile,
    dequantize_experts_fp8,
    fused_moe,
    fused_moe_config,
    fused_moe_reference,
    moe_align,
    quantize_experts_fp8,
    triton_moe_available,
)
from lumenrl_quant.fused_norm import rmsnorm_quantize_fp8
from lumenrl_quant.gemm import emulated_scaled_mm, gemm_path, scaled_mm
from lumenrl_quant.kv_cache import (
    KVScales,
    all_reduce_max_,
    calibrate_kv_scales,
    dequantize_kv,
    percentile_amax,
    quantize_kv,
)
from lumenrl_quant.linear import LINEAR_SCHEMES, QuantizedLinear
from lumenrl_quant.model import (
    QuantizationReport,
    ReloadReport,
    find_decoder_layers,
    quantize_model,
    reload_quantized_weights_,
)
from lumenrl_quant.mx import MXTensor, dequantize_mx, pack_fp4, quantize_mx, unpack_fp4
from lumenrl_quant.schemes import (
    MXFP4,
    MXFP8,
    QUANT_SCHEMES,
    Fp8Block,
    Fp8Row,
    Fp8Tensor,
    Fp8W8A16,
    get_quant_scheme,
)
from lumenrl_quant.training import (
    Fp8ConversionReport,
    Fp8TrainingConfig,
    Fp8TrainingLinear,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
    invalidate_fp8_weight_caches,
)

__all__ = [
    # FP8 training (lumenrl_quant.training)
    "Fp8ConversionReport",
    "Fp8TrainingConfig",
    "Fp8TrainingLinear",
    "attach_weight_cache_invalidation",
    "convert_to_fp8_training",
    "invalidate_fp8_weight_caches",
    # rollout correction (lumenrl_quant.correction)
    "MISGeometric",
    "MISSequence",
    "MISToken",
    "SeqMIS",
    "TISSequence",
    "TISToken",
    "apply_is_weights",
    "kl_rejection_mask",
    "mis_geometric_mask",
    "mis_sequence_mask",
    "mis_token_mask",
    "rollout_correction_metrics",
    "rollout_log_ratio",
    "seq_mis",
    "tis_sequence_weights",
    "tis_token_weights",
    # fused MoE experts (lumenrl_quant.fused_moe)
    "FusedMoEConfig",
    "MoETile",
    "dequantize_experts_fp8",
    "fused_moe",
    "fused_moe_config",
    "fused_moe_reference",
    "moe_align",
    "quantize_experts_fp8",
    "triton_moe_available",
    # formats, quantization, GEMM, rollout linears, KV cache
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FP8Dtypes",
    "FP8Format",
    "FP8_FORMATS",
    "Fp8Block",
    "Fp8Row",
    "Fp8W8A16",
    "Fp8Tensor",
    "KVScales",
    "LINEAR_SCHEMES",
    "MXFP4",
    "MXFP8",
    "MXTensor",
    "QUANT_SCHEMES",
    "QuantizationReport",
    "QuantizedLinear",
    "ReloadReport",
    "__version__",
    "all_reduce_max_",
    "amax_to_scale",
    "calibrate_kv_scales",
    "dequantize_fp8",
    "dequantize_kv",
    "dequantize_mx",
    "emulated_scaled_mm",
    "expand_block_scale",
    "find_decoder_layers",
    "fp8_dtypes_for",
    "fp8_format",
    "fp8_max",
    "gemm_path",
    "get_quant_scheme",
    "is_fnuz_device",
    "pack_fp4",
    "percentile_amax",
    "quantize_fp8",
    "quantize_fp8_with_scale",
    "quantize_kv",
    "quantize_model",
    "quantize_mx",
    "reload_quantized_weights_",
    "scaled_mm",
    "sqnr_db",
    "rmsnorm_quantize_fp8",
    "silu_mul_quantize",
    "swiglu_mlp_fp8",
    "swiglu_mlp_fp8_tokenwise",
    "unpack_fp4",
]
