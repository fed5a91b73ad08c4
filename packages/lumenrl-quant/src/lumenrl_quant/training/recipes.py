"""FP8 training recipes: which FP8 format and scale granularity each GEMM operand gets.

Design
------
A linear layer ``y = x @ W.T (+ b)`` with ``x`` (M, K) tokens x in-features and ``W`` (N, K)
runs three GEMMs per training step, each as ``scaled_mm(a, b) = a @ b.T`` with the reduction on
the last dim of both operands:

==========  ===================  ===================  ==========
GEMM        a (rows, reduce)     b (rows, reduce)     reduce dim
==========  ===================  ===================  ==========
forward     x        (M, K)      W        (N, K)      K
dgrad       dY       (M, N)      W^T      (K, N)      N
wgrad       dY^T     (N, M)      x^T      (K, M)      M (tokens)
==========  ===================  ===================  ==========

Every operand is quantized along its *own* reduction dim (dequant scales, ``x ≈ q * scale``,
``scale = amax / fp8_max``; see :mod:`lumenrl_quant.fp8`):

- ``tensorwise``: one scale per operand;
- ``rowwise``: one scale per row of the operand (per token / per output or input channel);
- ``blockwise`` (DeepSeek-V3): ``a`` operands in 1x128 groups, ``b`` operands in 128x128 blocks,
  so every GEMM is the 1x128 x 128x128 mode that ``torch._scaled_mm`` runs on H200.

Formats: ``e4m3`` quantizes everything to E4M3; ``hybrid`` uses E4M3 for x / W in forward and
E5M2 (more range, less precision) for the gradient ``dY`` in dgrad and wgrad. On AMD MI300 the
fnuz variants are used (auto-detected, overridable). Master weights, bias and the produced
gradients stay in their own dtype; only GEMM operands are FP8. Approximate: every FP8 cast
(round-to-nearest-even after scaling); exact: scales, transposes of tensorwise / 128x128 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lumenrl_quant.formats import fp8_dtypes_for
from lumenrl_quant.fp8 import quantize_fp8

__all__ = ["FP8_TRAINING_FORMATS", "FP8_TRAINING_RECIPES", "Fp8TrainingConfig", "QuantizedOperand", "Recipe"]

FP8_TRAINING_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise")
FP8_TRAINING_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")

_BLOCK_A = (1, 128)
_BLOCK_B = (128, 128)


@dataclass(kw_only=True, slots=True)
class Fp8TrainingConfig:
    """How :class:`~lumenrl_quant.training.Fp8TrainingLinear` runs its GEMMs."""

    recipe: str = "tensorwise"  # "tensorwise" | "rowwise" | "blockwise" (1x128 acts, 128x128 weights)
    fp8_format: str = "hybrid"  # "e4m3" everywhere, or "hybrid": E5M2 for gradients in backward
    weight_cache: bool = True  # reuse the quantized weight until the next optimizer step
    fnuz: bool | None = None  # force AMD fnuz formats (True) / OCP (False); None = by device

    def __post_init__(self) -> None:
        if self.recipe not in FP8_TRAINING_RECIPES:
            raise ValueError(
                f"recipe={self.recipe!r} is not an FP8 training recipe; allowed: {FP8_TRAINING_RECIPES}"
            )
        if self.fp8_format not in FP8_TRAINING_FORMATS:
            raise ValueError(
                f"fp8_format={self.fp8_format!r} is not supported; allowed: {FP8_TRAINING_FORMATS}"
            )

    @property
    def dim_multiple(self) -> int:
        """In/out features must be multiples of this (scaled-GEMM alignment, whole blocks)."""
        return 128 if self.recipe == "blockwise" else 16


@dataclass(frozen=True, slots=True)
class QuantizedOperand:
    """One FP8 GEMM operand: ``q`` (rows, reduce), its dequant ``scale`` and block size if any."""

    q: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None
    qt: torch.Tensor | None = None  # ``q.T`` contiguous, when the quantizer wrote it in the same pass

    def transposed(self) -> QuantizedOperand:
        """``(q.T, scale.T)``: exact for tensorwise and square-block scales (not rowwise)."""
        if self.qt is not None:  # tensorwise, both layouts already written: no copy
            return QuantizedOperand(q=self.qt, scale=self.scale, block_size=None, qt=self.q)
        exact = self.block_size == _BLOCK_B or (self.block_size is None and self.scale.numel() == 1)
        if not exact:
            raise ValueError(
                f"only tensorwise or 128x128 operands transpose exactly; got block {self.block_size}"
            )
        scale = self.scale if self.scale.dim() < 2 else self.scale.t().contiguous()
        return QuantizedOperand(q=self.q.t().contiguous(), scale=scale, block_size=self.block_size)


@dataclass(frozen=True, slots=True)
class Recipe:
    """A resolved config: the FP8 dtypes for one device and the per-operand granularity."""

    name: str
    forward_dtype: torch.dtype  # x, W (E4M3)
    grad_dtype: torch.dtype  # dY (E5M2 for hybrid, else E4M3)

    @classmethod
    def resolve(cls, config: Fp8TrainingConfig, device: torch.device) -> Recipe:
        dtypes = fp8_dtypes_for(device, fnuz=config.fnuz)
        grad = dtypes.e5m2 if config.fp8_format == "hybrid" else dtypes.e4m3
        return cls(name=config.recipe, forward_dtype=dtypes.e4m3, grad_dtype=grad)

    @property
    def weight_transposes_exactly(self) -> bool:
        """W^T for dgrad can be taken from the cached forward W without requantizing."""
        return self.name != "rowwise"

    def quantize(self, t: torch.Tensor, *, role: Literal["a", "b"], dtype: torch.dtype) -> QuantizedOperand:
        """Quantize a 2-D operand (rows, reduce) for the ``a`` or ``b`` side of ``scaled_mm``.

        Inside ``torch.compile`` the torch quantizer is traced (inductor fuses it); eager runs
        may use the Triton kernels of :mod:`lumenrl_quant.triton_kernels`.
        """
        backend = "torch" if torch.compiler.is_compiling() else "auto"
        if self.name == "blockwise":
            block = _BLOCK_A if role == "a" else _BLOCK_B
            q, scale = quantize_fp8(t, dtype=dtype, granularity="block", block_size=block, backend=backend)
            return QuantizedOperand(q=q, scale=scale, block_size=block)
        q, scale = quantize_fp8(t, dtype=dtype, granularity=self.name, backend=backend)
        return QuantizedOperand(q=q, scale=scale, block_size=None)
