"""FP8 training: ``convert_to_fp8_training`` swaps linears for FP8 scaled-GEMM linears.

See :mod:`lumenrl_quant.training.recipes` for the recipes and formats.
"""

from lumenrl_quant.training.convert import (
    Fp8ConversionReport,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
    invalidate_fp8_weight_caches,
)
from lumenrl_quant.training.linear import Fp8TrainingLinear, Fp8WeightCache
from lumenrl_quant.training.recipes import (
    FP8_TRAINING_FORMATS,
    FP8_TRAINING_RECIPES,
    Fp8TrainingConfig,
)

__all__ = [
    "FP8_TRAINING_FORMATS",
    "FP8_TRAINING_RECIPES",
    "Fp8ConversionReport",
    "Fp8TrainingConfig",
    "Fp8TrainingLinear",
    "Fp8WeightCache",
    "attach_weight_cache_invalidation",
    "convert_to_fp8_training",
    "invalidate_fp8_weight_caches",
]
