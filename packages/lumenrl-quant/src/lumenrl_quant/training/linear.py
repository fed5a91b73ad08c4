"""``Fp8TrainingLinear``: an ``nn.Linear`` whose three GEMMs run in FP8 (see ``recipes``).

Design
------
Forward quantizes ``x`` (M, K) and ``W`` (N, K) to E4M3 and calls :func:`lumenrl_quant.gemm.scaled_mm`
(``torch._scaled_mm`` where the device supports the mode, exact dequantize-and-matmul emulation
elsewhere; on CPU always the emulation, which is far faster there than torch's CPU FP8 kernel). Backward quantizes ``dY`` to the gradient format (E5M2 for ``hybrid``) and
computes ``dX = dY @ W`` and ``dW = dY^T @ x`` the same way; the bias gradient is a plain sum.
``x`` is saved in its own precision for wgrad; for wgrad the token dim is zero-padded to the
GEMM alignment (16, or 128 for blockwise), which changes no value.

Weight cache: the quantized ``W`` (and, for dgrad, ``W^T``) is kept in an :class:`Fp8WeightCache`
across micro-batches and dropped (a) by :func:`~lumenrl_quant.training.attach_weight_cache_invalidation`
after every ``optimizer.step()``, or by :func:`~lumenrl_quant.training.invalidate_fp8_weight_caches`,
and (b) automatically when the weight's storage or autograd version counter changed (in-place
updates), so a stale FP8 copy is never served. Updates through ``weight.data`` bypass the version
counter: those need (a). The cache costs 1 byte per weight element (2 when dgrad needs ``W^T``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_quant.gemm import emulated_scaled_mm, scaled_mm
from lumenrl_quant.training.recipes import Fp8TrainingConfig, QuantizedOperand, Recipe

__all__ = ["Fp8TrainingLinear", "Fp8WeightCache"]


class Fp8WeightCache:
    """Quantized copies of one weight (``"forward"``, ``"dgrad"``), valid until invalidated."""

    __slots__ = ("_entries", "_stamp", "quantizations")

    def __init__(self) -> None:
        self._entries: dict[str, QuantizedOperand] = {}
        self._stamp: tuple | None = None
        self.quantizations = 0  # how many times a weight was quantized (cache misses)

    def get(self, name: str, weight: torch.Tensor, make: Callable[[], QuantizedOperand]) -> QuantizedOperand:
        stamp = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if stamp != self._stamp:
            self._entries.clear()
            self._stamp = stamp
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = make()
            self.quantizations += 1
        return entry

    def invalidate(self) -> None:
        self._entries.clear()
        self._stamp = None

    def __len__(self) -> int:
        return len(self._entries)


def _cached(cache: Fp8WeightCache | None, name: str, weight: torch.Tensor, make) -> QuantizedOperand:
    return make() if cache is None else cache.get(name, weight, make)


def _forward_weight(weight: torch.Tensor, recipe: Recipe, cache: Fp8WeightCache | None) -> QuantizedOperand:
    return _cached(
        cache, "forward", weight, lambda: recipe.quantize(weight, role="b", dtype=recipe.forward_dtype)
    )


def _dgrad_weight(weight: torch.Tensor, recipe: Recipe, cache: Fp8WeightCache | None) -> QuantizedOperand:
    def make() -> QuantizedOperand:  # W^T (K, N), reduced over N
        if recipe.weight_transposes_exactly:
            return _forward_weight(weight, recipe, cache).transposed()
        return recipe.quantize(weight.t(), role="b", dtype=recipe.forward_dtype)

    return _cached(cache, "dgrad", weight, make)


def _mm(a: QuantizedOperand, b: QuantizedOperand, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    # CPU: torch._scaled_mm's CPU kernel is ~1000x slower than the exact emulation at training
    # shapes (measured, torch 2.13: 1.3 s vs 1 ms for 128x256x256), so CPU always emulates.
    # GPU: cuBLAS rowwise / blockwise FP8 GEMMs write bf16, so the GEMM outputs bf16 and is cast.
    on_cpu = a.q.device.type == "cpu"
    gemm = emulated_scaled_mm if on_cpu else scaled_mm
    out = gemm(
        a.q,
        a.scale,
        b.q,
        b.scale,
        out_dtype=out_dtype if on_cpu else torch.bfloat16,
        bias=bias,
        a_block_size=a.block_size,
        b_block_size=b.block_size,
    )
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _wgrad(grad: torch.Tensor, x: torch.Tensor, recipe: Recipe, weight_dtype: torch.dtype) -> torch.Tensor:
    multiple = 128 if recipe.name == "blockwise" else 16
    grad_t = _pad_rows(grad, multiple).t().contiguous()  # (N, Mp)
    x_t = _pad_rows(x, multiple).t().contiguous()  # (K, Mp)
    g = recipe.quantize(grad_t, role="a", dtype=recipe.grad_dtype)
    xq = recipe.quantize(x_t, role="b", dtype=recipe.forward_dtype)
    return _mm(g, xq, weight_dtype)  # (N, K)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe, cache: Fp8WeightCache | None):  # x: (M, K)
        w = _forward_weight(weight, recipe, cache)
        xq = recipe.quantize(x, role="a", dtype=recipe.forward_dtype)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.cache = recipe, cache
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _mm(xq, w, x.dtype, bias=bias)  # (M, N)

    @staticmethod
    def backward(ctx, grad):  # grad: (M, N)
        x, weight = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        grad = grad.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g = recipe.quantize(grad, role="a", dtype=recipe.grad_dtype)
            dx = _mm(g, _dgrad_weight(weight, recipe, ctx.cache), x.dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(grad, x, recipe, weight.dtype)
        if ctx.needs_input_grad[2]:
            db = grad.sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


class Fp8TrainingLinear(nn.Linear):
    """Drop-in ``nn.Linear`` computing forward, dgrad and wgrad as FP8 scaled GEMMs.

    Parameters keep their dtype (master weights); state-dict keys are those of ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: Fp8TrainingConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_config = config if config is not None else Fp8TrainingConfig()
        self.weight_cache = Fp8WeightCache() if self.fp8_config.weight_cache else None
        self._recipes: dict[torch.device, Recipe] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8TrainingConfig) -> Fp8TrainingLinear:
        """Wrap ``linear``'s own Parameters (an optimizer built before conversion keeps working)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            config=config,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def _recipe(self) -> Recipe:
        device = self.weight.device
        if device not in self._recipes:
            self._recipes[device] = Recipe.resolve(self.fp8_config, device)
        return self._recipes[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        if x2d.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        out = _Fp8LinearFunction.apply(x2d, self.weight, self.bias, self._recipe(), self.weight_cache)
        return out.reshape(*x.shape[:-1], self.out_features)

    def invalidate_weight_cache(self) -> None:
        if self.weight_cache is not None:
            self.weight_cache.invalidate()

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return f"{super().extra_repr()}, recipe={cfg.recipe}, fp8_format={cfg.fp8_format}, weight_cache={cfg.weight_cache}"
