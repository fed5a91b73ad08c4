"""``Fp8TrainingLinear``: an ``nn.Linear`` whose three GEMMs run in FP8 (see ``recipes``).

Design
------
Every GEMM is ``scaled_mm(a, b) = (a * sa) @ (b * sb).T`` with both operands row-major along the
reduction dim: ``torch._scaled_mm`` (cuBLASLt) runs only that "TN" layout (it gets ``b.t()``, a
column-major view, no copy), and on CPU the exact dequantize-and-matmul emulation runs instead
(far faster there than torch's CPU FP8 kernel).

Tensorwise fast path (``_TensorwiseFp8Linear``), the recipe that reaches the FP8 GEMM speedup:

* forward quantizes ``x`` once with :func:`lumenrl_quant.triton_training.quantize_with_transpose`,
  which writes ``x_q`` (M, K) for the forward GEMM *and* ``x_q^T`` (K, M) for wgrad in the same
  pass (dynamic scale computed on device, no host sync); only ``x_q^T`` and the scale are saved
  for backward (1 byte per element instead of the 2 of a bf16 ``x``);
* backward quantizes ``dY`` once (E5M2 for ``hybrid``) into ``dY_q`` (dgrad) and ``dY_q^T``
  (wgrad); ``dX = dY @ W`` uses the saved ``W_q^T``; ``dW = dY^T @ x`` the saved ``x_q^T``;
* the weight is quantized outside the autograd function into ``W_q`` and ``W_q^T`` (one fused
  pass), through the :class:`Fp8WeightCache` in eager mode.
* the token dim is zero-padded to 16 when needed (the wgrad reduction dim), which changes no value.

``rowwise`` / ``blockwise`` (``_Fp8LinearFunction``): x, dY and the transposed operands are each
quantized by their own pass (rowwise / 1x128 scales of ``x`` do not transpose), ``x`` is saved in
its own precision for wgrad and padded to the GEMM alignment (16, or 128 for blockwise) there.

Weight cache (eager): the quantized ``W`` (and, for dgrad, ``W^T``) is kept in an
:class:`Fp8WeightCache` across micro-batches and dropped (a) by
:func:`~lumenrl_quant.training.attach_weight_cache_invalidation` after every ``optimizer.step()``,
or by :func:`~lumenrl_quant.training.invalidate_fp8_weight_caches`, and (b) automatically when the
weight's storage or autograd version counter changed (in-place updates), so a stale FP8 copy is
never served. Updates through ``weight.data`` bypass the version counter: those need (a). The
cache costs 1 byte per weight element (2 when dgrad needs ``W^T``).

``torch.compile``: nothing that changes between steps is read while tracing (the cache, version
counters and data pointers stay in eager mode), so a compiled decoder layer compiles once and
never recompiles; inside the graph the weight is re-quantized each forward (fused by inductor,
about 3 bytes of traffic per weight element, small next to the GEMMs it feeds). The recipe (FP8
dtypes, whether the device has ``torch._scaled_mm``) is resolved eagerly, when the module is
built or moved, never inside a trace. No ``autograd.Function`` forward here returns a tensor that
another traced value aliases (casts are :func:`~lumenrl_quant.gemm.as_dtype`, never an identity
``.to``): torch 2.11's dynamo returns forward intermediates as extra outputs without dropping
aliases, which re-numbers the real output and zeroes every input gradient (pytorch#180642; the
H200 run's 0 dB weight gradients). ``tests/test_quant_fp8_training_compile_grads.py`` checks this
on CPU with dynamo put in that mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_quant.gemm import as_dtype, emulated_scaled_mm, scaled_mm
from lumenrl_quant.training.recipes import Fp8TrainingConfig, QuantizedOperand, Recipe
from lumenrl_quant.triton_training import quantize_with_transpose

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
    return as_dtype(out, out_dtype)  # never an identity ``to``: see the module doc (torch.compile)


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
            db = as_dtype(grad.sum(dim=0), ctx.bias_dtype)
        return dx, dw, db, None, None


def _gemm_tn(a, sa, b, sb, out_dtype: torch.dtype, fast: bool, bias=None, fast_accum=False) -> torch.Tensor:
    """``(a * sa) @ (b * sb).T (+ bias)``, tensorwise scales, ``a`` and ``b`` row-major FP8.

    ``fast_accum`` (forward only, as torchao.float8 does): Hopper's faster FP8 accumulation;
    the gradient GEMMs keep cuBLAS's periodic promotion to float32."""
    if fast:  # cuBLASLt wants mat2 column-major: b.t() is exactly that view of row-major b
        b16 = None if bias is None else as_dtype(bias, torch.bfloat16)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=b16, out_dtype=torch.bfloat16,
                               use_fast_accum=fast_accum)
        return as_dtype(out, out_dtype)
    out = (a.float() * sa) @ (b.float() * sb).t()  # the exact emulation (gemm.emulated_scaled_mm)
    if bias is not None:
        out = out + bias.float()
    return as_dtype(out, out_dtype)


def _quantize_pair(t: torch.Tensor, dtype: torch.dtype) -> QuantizedOperand:
    q, qt, scale = quantize_with_transpose(t, dtype)
    return QuantizedOperand(q=q, scale=scale, block_size=None, qt=qt)


class _TensorwiseFp8Linear(torch.autograd.Function):
    """Tensorwise recipe: x and dY quantized once each, both layouts from one pass (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_qt, w_scale, fwd_dtype, grad_dtype, fast):  # x: (M, K)
        m = x.shape[0]
        xq, xqt, xs = quantize_with_transpose(_pad_rows(x, 16), fwd_dtype)
        ctx.save_for_backward(xqt, xs, w_qt, w_scale)
        ctx.m, ctx.grad_dtype, ctx.fast = m, grad_dtype, fast
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        out = _gemm_tn(xq, xs, w_q, w_scale, x.dtype, fast, bias, fast_accum=True)  # (Mp, N)
        return out if out.shape[0] == m else out[:m]

    @staticmethod
    def backward(ctx, grad):  # grad: (M, N)
        xqt, xs, w_qt, w_scale = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = dw = db = None
        gq, gqt, gs = quantize_with_transpose(_pad_rows(grad, 16), ctx.grad_dtype)
        if ctx.needs_input_grad[0]:
            dx = _gemm_tn(gq, gs, w_qt, w_scale, x_dtype, ctx.fast)  # (Mp, K)
            dx = dx if dx.shape[0] == ctx.m else dx[: ctx.m]
        if ctx.needs_input_grad[1]:
            dw = _gemm_tn(gqt, gs, xqt, xs, w_dtype, ctx.fast)  # (N, K), reduced over tokens
        if ctx.needs_input_grad[2]:
            db = as_dtype(grad.sum(dim=0), b_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _fast_tensorwise_gemm(device: torch.device, in_features: int, out_features: int) -> bool:
    """``torch._scaled_mm`` tensorwise runs here (CUDA sm89+ or ROCm; dims multiples of 16)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    if in_features % 16 or out_features % 16:
        return False
    if getattr(torch.version, "hip", None) is not None:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


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
        self._resolve()

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
        new._resolve()
        return new

    def _resolve(self) -> None:
        """Resolve the recipe for the weight's device, eagerly (never inside a torch.compile trace)."""
        device = self.weight.device
        self._fp8_device = device
        self._fp8_recipe = Recipe.resolve(self.fp8_config, device)
        self._fp8_fast_gemm = _fast_tensorwise_gemm(device, self.in_features, self.out_features)

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / to_empty(): re-resolve for the new device
        out = super()._apply(fn, recurse)
        self._resolve()
        return out

    def _recipe(self) -> Recipe:
        if self.weight.device != self._fp8_device:  # params replaced without _apply (e.g. by FSDP)
            self._resolve()
        return self._fp8_recipe

    def _tensorwise_weight(self, recipe: Recipe) -> QuantizedOperand:
        """``W_q`` with its ``W_q^T`` (one pass); cached across micro-batches in eager mode."""
        weight = self.weight.detach()
        cache = self.weight_cache
        if cache is None or torch.compiler.is_compiling():
            return _quantize_pair(weight, recipe.forward_dtype)
        fwd = cache.get("forward", self.weight, lambda: _quantize_pair(weight, recipe.forward_dtype))
        cache.get("dgrad", self.weight, fwd.transposed)  # W^T for dgrad: the layout written above
        return fwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        if x2d.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        recipe = self._recipe()
        if recipe.name == "tensorwise":
            w = self._tensorwise_weight(recipe)
            out = _TensorwiseFp8Linear.apply(
                x2d, self.weight, self.bias, w.q, w.qt, w.scale,
                recipe.forward_dtype, recipe.grad_dtype, self._fp8_fast_gemm,
            )
        else:
            cache = None if torch.compiler.is_compiling() else self.weight_cache
            out = _Fp8LinearFunction.apply(x2d, self.weight, self.bias, recipe, cache)
        return out.reshape(*x.shape[:-1], self.out_features)

    def invalidate_weight_cache(self) -> None:
        if self.weight_cache is not None:
            self.weight_cache.invalidate()

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return f"{super().extra_repr()}, recipe={cfg.recipe}, fp8_format={cfg.fp8_format}, weight_cache={cfg.weight_cache}"
