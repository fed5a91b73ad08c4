"""Fused tensorwise FP8 quantization for training: one read of ``x`` writes ``q`` and ``q^T``.

Design
------
``torch._scaled_mm`` (cuBLASLt) only runs the "TN" layout: the first operand row-major, the
second column-major, both with the reduction dim contiguous. A training linear therefore needs
each FP8 operand in two layouts (see :mod:`lumenrl_quant.training.linear`): ``x`` (M, K) for the
forward GEMM and ``x^T`` (K, M) for wgrad; ``dY`` (M, N) for dgrad and ``dY^T`` (N, M) for wgrad;
``W`` (N, K) for forward and ``W^T`` (K, N) for dgrad. :func:`quantize_with_transpose` produces both
layouts of one tensorwise quantization:

* amax: ``torch.linalg.vector_norm(x, inf)``, one reduction kernel (no ``abs`` temporary), on
  device (no host sync);
* cast: the Triton kernel ``_quant_t_kernel`` loads a ``BLOCK_M x BLOCK_K`` tile once, derives the
  dequant scale ``amax / fp8_max`` (1 for an all-zero tensor) from the amax in device memory,
  divides with IEEE round-to-nearest (``div_rn``), saturates, casts (round-to-nearest-even) and
  stores the tile to ``q`` and, transposed in registers, to ``q^T``. Bit-identical to the torch
  path (:func:`quantize_with_transpose_torch`, and to :func:`lumenrl_quant.fp8.quantize_fp8`
  tensorwise), checked under ``TRITON_INTERPRET=1`` on CPU and on GPU by the benchmark.

Set ``LUMENRL_FP8_TRAIN_TRITON=0`` to force the torch path in eager mode; a Triton failure at run
time warns once and falls back to it.

Backends: ``"auto"`` = Triton on a CUDA tensor when Triton is installed and not inside
``torch.compile``, torch otherwise; inside ``torch.compile`` the torch ops are traced, so inductor
fuses the amax with the producer and the cast/transposed copies with each other
(:data:`COMPILED_BACKEND` = ``"inductor"``, the default), or, with ``"triton"``, the Triton kernel
runs as the opaque custom op ``lumenrl_quant::fp8_quantize_with_transpose``.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from lumenrl_quant.formats import fp8_max

__all__ = [
    "COMPILED_BACKENDS",
    "fp8_quantize_with_transpose_triton",
    "quantize_with_transpose",
    "quantize_with_transpose_torch",
    "set_compiled_backend",
    "tensor_amax",
    "triton_importable",
]

COMPILED_BACKENDS: tuple[str, ...] = ("inductor", "triton")
COMPILED_BACKEND = "inductor"  # what quantize_with_transpose runs inside torch.compile

BLOCK_M, BLOCK_K, NUM_WARPS = 128, 128, 8


def set_compiled_backend(backend: str) -> None:
    """Choose the quantizer traced into ``torch.compile`` graphs: ``"inductor"`` or ``"triton"``."""
    global COMPILED_BACKEND
    if backend not in COMPILED_BACKENDS:
        raise ValueError(f"backend={backend!r} is not a compiled quantize backend; allowed: {COMPILED_BACKENDS}")
    COMPILED_BACKEND = backend


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in ``x``'s dtype (exact), one reduction, no ``abs`` temporary; 0 for an empty ``x``
    (whose quantization then gets the unit scale)."""
    if x.numel() == 0:  # the inf-norm of an empty tensor raises (no identity)
        return x.new_zeros(())
    return torch.linalg.vector_norm(x, float("inf"))


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    amax = amax.float()  # divide by a tensor: a Python scalar becomes a (not exactly rounded) reciprocal on CUDA
    return torch.where(amax > 0, amax / torch.full_like(amax, fp8_max(dtype)), torch.ones_like(amax))


def quantize_with_transpose_torch(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(q, q^T contiguous, scale)`` of a tensorwise quantization of the 2-D ``x``."""
    scale = _scale_from_amax(tensor_amax(x), dtype)
    limit = fp8_max(dtype)
    q = (x.float() / scale).clamp(-limit, limit).to(dtype)
    return q, q.t().contiguous(), scale


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (so ``TRITON_INTERPRET`` set by then is honoured)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_t_kernel(
        x_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, M, K, stride_xm, stride_xk,
        FP8_MAX: tl.constexpr, OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # int64: offsets may pass 2**31
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        amax = tl.load(amax_ptr).to(tl.float32)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        q = tl.math.div_rn(x.to(tl.float32), scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX).to(OUT)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))
        if (pid_m == 0) & (pid_k == 0):
            tl.store(s_ptr, scale)

    return _quant_t_kernel


def fp8_quantize_with_transpose_triton(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`quantize_with_transpose_torch` (2-D ``x``, any strides)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, cols); got shape {tuple(x.shape)}")
    from lumenrl_quant.triton_kernels import _tl_fp8  # the torch -> Triton FP8 dtype table

    kernel, out_dtype = _kernel(), _tl_fp8(dtype)  # raises for a non-FP8 dtype
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    qt = torch.empty((k, m), dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, qt, scale.fill_(1.0)
    amax = tensor_amax(x)
    grid = (-(-m // BLOCK_M), -(-k // BLOCK_K))
    kernel[grid](
        x, amax, q, qt, scale, m, k, x.stride(0), x.stride(1),
        FP8_MAX=fp8_max(dtype), OUT=out_dtype, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )
    return q, qt, scale


@torch.library.custom_op("lumenrl_quant::fp8_quantize_with_transpose", mutates_args=())
def _quantize_with_transpose_op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.is_cuda and triton_importable():
        return fp8_quantize_with_transpose_triton(x, dtype)
    q, qt, scale = quantize_with_transpose_torch(x, dtype)
    return q, qt, scale


@_quantize_with_transpose_op.register_fake
def _(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


_TRITON_FAILED: list[str] = []  # the first failure's message; the torch path runs from then on


def _triton_ok(x: torch.Tensor) -> bool:
    return (x.is_cuda and not _TRITON_FAILED and triton_importable()
            and os.environ.get("LUMENRL_FP8_TRAIN_TRITON", "1") != "0")


def quantize_with_transpose(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q^T, scale)`` of the 2-D ``x`` (see module doc for which backend runs)."""
    if torch.compiler.is_compiling():
        if COMPILED_BACKEND == "triton":
            return _quantize_with_transpose_op(x, dtype)
        return quantize_with_transpose_torch(x, dtype)
    if _triton_ok(x):
        try:
            return fp8_quantize_with_transpose_triton(x, dtype)
        except Exception as err:  # a Triton build without this feature: never fail the training step
            if torch.cuda.is_current_stream_capturing():
                raise
            _TRITON_FAILED.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"fused FP8 quantize+transpose kernel failed ({_TRITON_FAILED[0][:300]}); "
                          "using the torch path", stacklevel=2)
    return quantize_with_transpose_torch(x, dtype)
