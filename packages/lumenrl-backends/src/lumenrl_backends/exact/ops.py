"""Batch-invariant operators: each token's result is a function of that token's inputs only.

Why: the rollout engine and the trainer run the same weights on the same tokens, but in different
batch shapes (decode: one new token per sequence against a KV cache, any number of sequences;
training: whole sequences, packed or padded). Ordinary kernels pick their reduction order from the
shape (GEMM tiling and split-K by M, reduction kernels that split a row over blocks when there are
few rows, attention that walks keys by cache column), so the same token gets different roundings.
The operators below fix every reduction order per token:

* ``exact_linear`` x (M, K) @ W (N, K)^T: every output element is reduced over K in one fixed order
  that does not depend on M. CUDA: a Triton GEMM with one fixed tile shape, no split-K
  (:mod:`~lumenrl_backends.exact.triton_ops`). CPU: float32 products summed over a contiguous last
  axis of length K, row by row (torch's inner-axis sum depends only on K). Backward: plain matmuls
  (gradients need not be invariant; only the forward values are compared).
* ``exact_rms_norm``: HF's formula ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``; one row per
  program on CUDA, the inner-axis mean on CPU.
* ``exact_lse`` / ``exact_token_log_probs``: ``z = float(x) / t``, ``lse = m + log(sum(exp(z - m)))``
  per row in a fixed order (two passes over V in fixed blocks on CUDA).
* ``exact_silu``, ``exact_cos_sin``, ``_vector_safe``: on CPU torch evaluates a transcendental
  elementwise op with SIMD code for whole vectors and scalar libm code for a loop's tail, which
  may differ in the last bit, so an element's value would depend on where it sits in the tensor.
  These run the op on contiguous pieces of a multiple of 64 elements (at most 32768, one thread):
  every element takes the vector path. On CUDA elementwise ops are position-independent as is.

Attention (keys in rank order) is in :mod:`~lumenrl_backends.exact.attention`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = [
    "exact_linear",
    "exact_lse",
    "exact_rms_norm",
    "exact_silu",
    "exact_token_log_probs",
    "vector_safe",
]

_PIECE = 32768  # elements per CPU call of an elementwise op: below torch's parallel grain (one thread)
_ALIGN = 64  # a multiple of every SIMD loop step (2 vectors of up to 16 floats, doubled)
_CPU_CHUNK = 1 << 22
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton does  # float32 elements of the (rows, N, K) product per CPU linear chunk


def _use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors, or any tensor under ``TRITON_INTERPRET=1`` (the CPU tests of the kernels)."""
    if not (t.is_cuda or _INTERPRETED):
        return False
    from lumenrl_backends.exact import triton_ops

    return triton_ops.AVAILABLE


def vector_safe(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (elementwise) applied so that every element takes the same code path (CPU; see module doc)."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % _ALIGN
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() <= _PIECE:
        out = fn(flat)
    else:
        out = torch.cat([fn(piece) for piece in flat.split(_PIECE)])
    return out[:n].view(x.shape)


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    return vector_safe(torch.nn.functional.silu, x)


# ----------------------------------------------------------------------------- linear
def _linear_cpu(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(M, K) x (N, K) -> (M, N) float32: each element a float32 sum over K of exact-order products."""
    m, k = x2.shape
    n = weight.shape[0]
    wf = weight.float()  # (N, K)
    out = torch.empty((m, n), dtype=torch.float32, device=x2.device)
    rows = max(1, _CPU_CHUNK // max(n * k, 1))
    for s in range(0, m, rows):
        out[s : s + rows] = (x2[s : s + rows].float()[:, None, :] * wf[None]).sum(-1)  # (r, N, K) -> (r, N)
    return out


def _linear_forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _use_triton(x2):
        from lumenrl_backends.exact import triton_ops

        return triton_ops.matmul(x2, weight, bias)
    acc = _linear_cpu(x2, weight)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x2.dtype)


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x2, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        gx = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad.t() @ x2.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a batch-invariant forward: x (..., K), weight (N, K) -> (..., N) in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    out = _ExactLinear.apply(x2, weight, bias)
    return out.view(*shape[:-1], weight.shape[0])


# ----------------------------------------------------------------------------- RMSNorm
def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm (Llama/Qwen): ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, row-invariant."""
    if _use_triton(x) and not torch.is_grad_enabled():
        from lumenrl_backends.exact import triton_ops

        return triton_ops.rms_norm(x, weight, eps)
    if _use_triton(x):
        return _RMSNormTriton.apply(x, weight, eps)
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)  # inner-axis reduction: depends only on the row
    h = h * torch.rsqrt(variance + eps)  # sqrt and division are correctly rounded on every path
    return weight * h.to(x.dtype)


class _RMSNormTriton(torch.autograd.Function):
    """Triton forward; backward by autograd over the torch formula (recomputed, same math)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from lumenrl_backends.exact import triton_ops

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return triton_ops.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            h = xd.float()
            out = wd * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            gx, gw = torch.autograd.grad(out, (xd, wd), grad)
        return gx, gw, None


# ----------------------------------------------------------------------------- log-softmax
def exact_lse(z: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last axis of float32 z (N, V) -> (N,), in a fixed per-row order."""
    if _use_triton(z):
        from lumenrl_backends.exact import triton_ops

        return triton_ops.lse(z)
    m = z.amax(dim=-1, keepdim=True)  # max: order-free
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = vector_safe(torch.exp, z - m).sum(-1)  # inner-axis sum of a fixed length V
    return vector_safe(torch.log, total) + m.squeeze(-1)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        z = logits.float() / temperature  # (N, V); temperature (N, 1)
        lse = exact_lse(z)  # (N,)
        out = z.gather(-1, tokens[:, None])[:, 0] - lse
        ctx.save_for_backward(logits, tokens, temperature, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, tokens, temperature, lse = ctx.saved_tensors
        z = logits.float() / temperature
        p = torch.exp(z - lse[:, None])
        onehot = torch.zeros_like(p).scatter_(-1, tokens[:, None], 1.0)
        gz = grad[:, None].float() * (onehot - p) / temperature
        return gz.to(logits.dtype), None, None


def exact_token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log_softmax(float(logits) / t)[token] per row: logits (..., V), tokens (...) -> float32 (...).

    ``temperature``: a float or a tensor broadcastable to ``tokens`` (the engine's per-row values);
    0 or less means 1 (greedy rows, the engine's convention). Differentiable w.r.t. ``logits``."""
    shape = tokens.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = torch.where(t > 0, t, torch.ones_like(t)).expand(shape).reshape(-1, 1).contiguous()
    return _TokenLogProbs.apply(flat, tokens.reshape(-1).long(), t).view(shape)
