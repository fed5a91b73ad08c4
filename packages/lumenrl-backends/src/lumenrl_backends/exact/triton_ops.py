"""Triton kernels of the exact mode (CUDA; the CPU tests run them in Triton's interpreter).

Every kernel's launch configuration (tile sizes, warps, stages) is a constant or a function of the
model's dimensions only (K, N, hidden size, head dim, group size), never of the number of tokens,
so a token's result does not depend on how many tokens share the launch:

* :func:`matmul` x (M, K) @ w (N, K)^T: one output tile (BLOCK_M x BLOCK_N) per program, the whole
  K loop in that program in BLOCK_K steps (no split-K), float32 accumulator, optional bias, cast at
  the end. BLOCK_M is fixed at 64 whatever M (a decode step of 64 sequences is one M tile).
* :func:`rms_norm`: one row per program, the whole row in one block (``tl.sum`` over a fixed layout).
* :func:`lse`: one row per program, two passes over V in fixed blocks (max, then sum of exp, the
  block sums added in block order).
* :func:`attention`: one program per (token, KV head) with the group's query heads as the rows of a
  16-row tile; keys in rank blocks of :data:`~lumenrl_backends.exact.attention.BLOCK_KEYS` x 4 from the
  token's first allowed column, online softmax; the same program for a decode step and for every
  token of a causal prefill or a training sequence. Backward (training): recomputed through
  ``F.scaled_dot_product_attention`` with the same boolean mask (gradients need not be invariant).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["AVAILABLE", "attention", "lse", "matmul", "rms_norm"]

AVAILABLE = triton is not None
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MM_BLOCK_M = 64


def mm_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the GEMM for a weight (N, K): a function of the weight's
    shape only, so every M (a decode step, a training micro-batch) reduces K in the same order.
    From ``benchmarks.exact.bench_exact:sweep_matmul`` on an H200 (8B linears at M=64 and 4096):
    narrow weights (K/V projections) need narrow tiles to put enough programs on the SMs at decode;
    wide ones (gate/up, LM head) and the fused-width QKV take 128 x 128 tiles (fast training, near
    cuBLAS at decode); the square-ish rest (o, down) stream K in 128-wide steps with 64-wide tiles."""
    if n <= 2048:
        return (32, 128, 4, 4)
    if n >= 6144:
        return (128, 128, 8, 4)
    return (64, 128, 8, 4)


ATTN_BLOCK_N, ATTN_WARPS = 64, 4  # a multiple of attention.BLOCK_KEYS (rank blocks stay aligned)
LSE_BLOCK = 4096

if AVAILABLE:

    @triton.jit
    def _matmul_kernel(A, B, C, BIAS, M, N, K: tl.constexpr, s_am, s_bn, s_cm, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # grouped tile order (L2 reuse of A and B across neighbouring programs); the arithmetic of a tile
        # does not depend on which program computes it
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(A + rm[:, None].to(tl.int64) * s_am + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(B + rn[None, :].to(tl.int64) * s_bn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(C + rm[:, None].to(tl.int64) * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _rms_kernel(X, W, Y, H, s_x, s_y, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * s_x + cols, mask=cols < H, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / H
        h = (xf * (1.0 / tl.sqrt_rn(var + eps))).to(x.dtype)
        w = tl.load(W + cols, mask=cols < H, other=0.0)
        tl.store(Y + row * s_y + cols, (w.to(tl.float32) * h.to(tl.float32)).to(Y.dtype.element_ty), mask=cols < H)

    @triton.jit
    def _lse_kernel(Z, OUT, V: tl.constexpr, s_z, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        for v0 in range(0, V, BLOCK):
            z = tl.load(Z + row * s_z + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
            m = tl.maximum(m, tl.max(z, axis=0))
        m = tl.where(m == float("-inf"), 0.0, m)
        total = 0.0
        for v0 in range(0, V, BLOCK):
            z = tl.load(Z + row * s_z + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
            total += tl.sum(tl.exp(z - m), axis=0)
        tl.store(OUT + row, tl.log(total) + m)

    @triton.jit
    def _attn_block(qt, kbase, vbase, r0, n, d, dv, start, count, s_kl, s_vl, scale, m_i, l_i, acc):
        """Keys of ranks r0 .. r0 + BLOCK_N (columns start + rank) into the online softmax."""
        rank = r0 + n
        ok = rank < count
        cols = (start + rank).to(tl.int64)
        kt = tl.load(kbase + cols[None, :] * s_kl + d[:, None], mask=ok[None, :], other=0.0)
        s = tl.dot(qt, kt, input_precision="ieee") * scale  # (BLOCK_G, BLOCK_N) float32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
        p = tl.where(ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vbase + cols[:, None] * s_vl + dv[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _attn_kernel(Q, K, V, OUT, START, COUNT, Lq, scale,
                     s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_ol, s_oh,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     BLOCK_N: tl.constexpr, MAX_KEYS: tl.constexpr):
        tok = tl.program_id(0)  # b * Lq + q
        hk = tl.program_id(1)
        b = (tok // Lq).to(tl.int64)
        q = (tok % Lq).to(tl.int64)
        start = tl.load(START + tok)
        count = tl.load(COUNT + tok)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        heads = hk * G + g
        qt = tl.load(Q + b * s_qb + heads[:, None].to(tl.int64) * s_qh + q * s_ql + d[None, :], mask=g[:, None] < G,
                     other=0.0)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, DV), tl.float32)
        n = tl.arange(0, BLOCK_N)
        kbase = K + b * s_kb + hk * s_kh
        vbase = V + b * s_vb + hk * s_vh
        # a runtime bound on the GPU; the interpreter needs a constant one (MAX_KEYS > 0): blocks past
        # ``count`` are then fully masked and change nothing (alpha 1, p 0)
        if MAX_KEYS > 0:
            for r0 in range(0, MAX_KEYS, BLOCK_N):
                m_i, l_i, acc = _attn_block(qt, kbase, vbase, r0, n, d, dv, start, count, s_kl, s_vl, scale, m_i, l_i, acc)
        else:
            for r0 in range(0, count, BLOCK_N):
                m_i, l_i, acc = _attn_block(qt, kbase, vbase, r0, n, d, dv, start, count, s_kl, s_vl, scale, m_i, l_i, acc)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * s_ob + q * s_ol + heads[:, None].to(tl.int64) * s_oh + dv[None, :],
                 out.to(OUT.dtype.element_ty), mask=g[:, None] < G)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) contiguous, w (N, K) -> (M, N) in x's dtype (fixed tiles, no split-K)."""
    M, K = x.shape
    N = w.shape[0]
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = mm_config(N, K)
    grid = (triton.cdiv(M, MM_BLOCK_M) * triton.cdiv(N, block_n),)
    _matmul_kernel[grid](x, w, out, bias if bias is not None else out, M, N, K, x.stride(0), w.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=MM_BLOCK_M, BLOCK_N=block_n,
                         BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    H = shape[-1]
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, H, x2.stride(0), out.stride(0), float(eps),
                                    BLOCK=triton.next_power_of_2(H), num_warps=4 if H <= 2048 else 8)
    return out.view(shape)


def lse(z: torch.Tensor) -> torch.Tensor:
    """float32 z (N, V) -> (N,) logsumexp per row."""
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _lse_kernel[(z.shape[0],)](z, out, z.shape[1], z.stride(0), BLOCK=LSE_BLOCK, num_warps=8)
    return out


def _attention_forward(q, k, v, start, count, scale: float) -> torch.Tensor:
    B, H, Lq, D = q.shape
    Hkv, DV = k.shape[1], v.shape[-1]
    G = H // Hkv
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((B, Lq, H, DV), dtype=q.dtype, device=q.device)  # HF layout
    if B * Lq:
        _attn_kernel[(B * Lq, Hkv)](
            q, k, v, out, start, count, Lq, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, DV=DV, BLOCK_N=ATTN_BLOCK_N,
            MAX_KEYS=k.shape[2] if _INTERPRETED else 0, num_warps=ATTN_WARPS,
        )
    return out


def _dense_mask(start: torch.Tensor, count: torch.Tensor, kv_len: int) -> torch.Tensor:
    cols = torch.arange(kv_len, device=start.device)
    rel = cols - start[..., None].long()
    allowed = (rel >= 0) & (rel < count[..., None].long())
    allowed |= (count[..., None] == 0) & (cols == 0)  # a query that sees nothing (padding): finite gradients
    return allowed[:, None]  # (B, 1, Lq, Lk)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, start, count, scale):
        ctx.save_for_backward(q, k, v, start, count)
        ctx.scale = scale
        return _attention_forward(q, k, v, start, count, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, start, count = ctx.saved_tensors
        mask = _dense_mask(start, count, k.shape[2])
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=ctx.scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            gq, gk, gv = torch.autograd.grad(out.transpose(1, 2), (qd, kd, vd), grad)
        return gq, gk, gv, None, None, None


def attention(q, k, v, start, count, scale: float) -> torch.Tensor:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D), start/count (B, Lq) int32 -> (B, Lq, H, Dv)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, start, count, float(scale))
    return _attention_forward(q, k, v, start, count, float(scale))
