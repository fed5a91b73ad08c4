"""lumenrl-quant: low-precision library for RL, depends on torch only.

FP8 / MXFP8 / MXFP4 formats and quantization, scaled GEMM, quantized linear layers and model
quantization for rollout, FP8 KV cache with scale calibration, FP8 training, TIS/MIS rollout
correction. See the package README for examples.
"""

from lumenrl_quant.__about__ import __version__
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
from lumenrl_quant.gemm import emulated_scaled_mm, gemm_path, scaled_mm

__all__ = [
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FP8Dtypes",
    "FP8Format",
    "FP8_FORMATS",
    "__version__",
    "amax_to_scale",
    "dequantize_fp8",
    "emulated_scaled_mm",
    "expand_block_scale",
    "fp8_dtypes_for",
    "fp8_format",
    "fp8_max",
    "gemm_path",
    "is_fnuz_device",
    "quantize_fp8",
    "quantize_fp8_with_scale",
    "scaled_mm",
]
