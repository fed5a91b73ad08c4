"""Token log-probs and entropy in one pass over the logits, and their gradient in one more (Triton).

The math of :mod:`.logprobs` (``z = float32(x) / t``, ``lse``, ``log_prob = z[y] - lse``,
``H = lse - sum p z``, ``dx = (g_lp (onehot - p) - g_H p (z - lse + H)) / t``), as two kernels:

* forward, one program per row: an online softmax over the vocabulary in chunks keeps the running
  maximum ``m``, ``s = sum exp(z - m)`` and ``u = sum exp(z - m) (z - m)`` (both rescaled when ``m``
  grows: ``u <- e^(m - m') (u + (m - m') s)``), so the row is read once; then ``lse = m + log s``,
  ``H = log s - u / s`` (two non-negative terms: no cancellation, as the centered form in
  :mod:`.logprobs`) and ``z[y]`` from one more load;
* backward, one program per (row, vocabulary chunk): the gradient from the row's ``lse``, ``H`` and
  incoming gradients, written in the logits' dtype.

The logits are read once forward and once backward, and the gradient written once: inductor's
kernels for the same formulas read the logits three times forward (max, sum, entropy passes).
``-inf`` logits (masked vocabulary) give probability 0 and no NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: the callers keep the compiled-kernel path
    triton = None

__all__ = ["BACKWARD", "FORWARD", "available", "token_log_probs_backward", "token_log_probs_forward"]

# Launch parameters (``bench_logprobs.py`` times alternatives side by side; a caller may pass its own ``config``):
# forward: vocabulary chunk per loop step, warps, software-pipeline stages of the chunk loop, and ``prefetch`` (load
# the next chunk before reducing this one: twice the bytes in flight per program); backward: chunk, chunks per
# program (a loop, pipelined by ``stages``), warps.
# The defaults are the fastest of ``bench_logprobs.py``'s sweep (decision 0023, "The training log-prob kernels").
FORWARD = {"block": 4096, "num_warps": 4, "stages": 1, "prefetch": True}
BACKWARD = {"block": 2048, "chunks": 1, "num_warps": 8, "stages": 1}


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, y_ptr, lse_ptr, lp_ptr, ent_ptr, vocab, rows_per_batch, stride_b, stride_t, inv_t,
                        WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                        STAGES: tl.constexpr, PREFETCH: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t
        m = tl.zeros((), dtype=tl.float32) - float("inf")
        s = tl.zeros((), dtype=tl.float32)
        u = tl.zeros((), dtype=tl.float32)
        offs = tl.arange(0, BLOCK)
        ahead = tl.load(base + offs, mask=offs < vocab, other=-float("inf"))
        for block in tl.range(0, NUM_BLOCKS, num_stages=STAGES):  # the vocabulary is fixed per model: one compile
            if PREFETCH:  # this chunk was loaded one step earlier; issue the next one's load before reducing it
                x = ahead
                cols = (block + 1) * BLOCK + offs  # past the vocabulary on the last step: fully masked, no access
                ahead = tl.load(base + cols, mask=cols < vocab, other=-float("inf"))
            else:
                cols = block * BLOCK + offs
                x = tl.load(base + cols, mask=cols < vocab, other=-float("inf"))
            z = x.to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: exp(z - 0) = 0, no NaN
            shift = tl.where(s > 0, m - m_ref, 0.0)  # 0 before the first finite value
            alpha = tl.exp(shift)
            e = tl.exp(z - m_ref)
            if WITH_ENTROPY:
                u = alpha * (u + shift * s) + tl.sum(tl.where(e > 0, e * (z - m_ref), 0.0), axis=0)
            s = s * alpha + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        target = tl.load(y_ptr + row)
        zy = tl.load(base + target).to(tl.float32) * inv_t
        tl.store(lse_ptr + row, lse)
        tl.store(lp_ptr + row, zy - lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, log_s - u / s)

    @triton.jit
    def _backward_kernel(x_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dx_ptr, vocab, rows_per_batch, stride_b,
                         stride_t, inv_t, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                         STAGES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t
        lse = tl.load(lse_ptr + row)
        target = tl.load(y_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        if WITH_ENTROPY:
            h = tl.load(ent_ptr + row)
            g_h = tl.load(gent_ptr + row)
        first = tl.program_id(1) * (BLOCK * CHUNKS)
        for chunk in tl.range(0, CHUNKS, num_stages=STAGES):
            cols = first + chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < vocab
            z = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
            p = tl.exp(z - lse)
            onehot = (cols == target).to(tl.float32)
            dz = g_lp * (onehot - p)
            if WITH_ENTROPY:
                dz -= g_h * tl.where(p > 0, p * (z - lse + h), 0.0)
            tl.store(dx_ptr + row * vocab + cols, (dz * inv_t).to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(x3, rows per batch, batch stride, row stride)`` of (..., V) logits as (B, T, V) without a copy where
    the rows are contiguous along V (a response slice ``logits[:, :-1]`` is such a view: the kernels index its
    rows through the two strides instead of a flattened copy)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() != 3:
        x = x.reshape(1, -1, x.shape[-1])
    return x, x.shape[1], x.stride(0), x.stride(1)


def token_log_probs_forward(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool,
                            config: Mapping[str, Any] | None = None):
    """``(lse, log_prob, entropy or None)`` (float32, ``tokens``' shape) of logits (..., V); ``config`` overrides
    :data:`FORWARD`'s launch parameters."""
    cfg = {**FORWARD, **(config or {})}
    x, rows, stride_b, stride_t = _rows(logits)
    y = tokens.reshape(-1).contiguous()
    n, vocab = x.shape[0] * rows, x.shape[2]
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    lp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else lse
    if n:
        _forward_kernel[(n,)](x, y, lse, lp, ent, vocab, rows, stride_b, stride_t, 1.0 / temperature,
                              WITH_ENTROPY=with_entropy, BLOCK=cfg["block"],
                              NUM_BLOCKS=triton.cdiv(vocab, cfg["block"]), STAGES=cfg["stages"],
                              PREFETCH=bool(cfg["prefetch"]), num_warps=cfg["num_warps"])
    shape = tokens.shape
    return lse.view(shape), lp.view(shape), (ent.view(shape) if with_entropy else None)


def token_log_probs_backward(logits, tokens, lse, entropy, g_lp, g_ent, temperature: float,
                             config: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The gradient of ``g_lp . log_prob + g_ent . entropy`` with respect to ``logits`` (its dtype and shape);
    ``entropy``/``g_ent`` None: log-probs only. ``config`` overrides :data:`BACKWARD`'s launch parameters."""
    cfg = {**BACKWARD, **(config or {})}
    x, rows, stride_b, stride_t = _rows(logits)
    n, vocab = x.shape[0] * rows, x.shape[2]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=x.device)  # contiguous: row r at r * vocab
    with_entropy = g_ent is not None
    flat = [t.reshape(-1).contiguous().float() if t is not None else None for t in (lse, entropy, g_lp, g_ent)]
    lse_f, ent_f, glp_f, gent_f = flat
    if n:
        _backward_kernel[(n, triton.cdiv(vocab, cfg["block"] * cfg["chunks"]))](
            x, tokens.reshape(-1).contiguous(), lse_f, ent_f if with_entropy else lse_f, glp_f,
            gent_f if with_entropy else glp_f, grad, vocab, rows, stride_b, stride_t, 1.0 / temperature,
            WITH_ENTROPY=with_entropy, BLOCK=cfg["block"], CHUNKS=cfg["chunks"], STAGES=cfg["stages"],
            num_warps=cfg["num_warps"])
    return grad
