"""Triton grouped GEMM over expert-sorted token blocks: the two launches of :func:`lumenrl_quant.fused_moe`.

One kernel, two uses (``GATED`` / ``ROUTED`` are compile-time flags):

* gate/up: rows ``a = hidden[pair // top_k]`` (H), expert weight ``w[e]`` (2I, H); each program owns
  BLOCK_N features of both halves (rows ``n`` and ``I + n``) and writes ``silu(gate) * up`` (float32
  math, one rounding to the output dtype) for the pairs of its block: ``inter[pair]`` (I);
* down: rows ``a = inter[pair]`` (I), expert weight ``w[e]`` (H, I); the epilogue multiplies by the
  pair's routing weight and writes ``out[pair]`` (H), one row per (token, k) pair; the caller sums
  over k (deterministic: no atomics).

A program handles one BLOCK_M block of the sorted pair list (:func:`lumenrl_quant.moe.moe_align`:
every block holds pairs of a single expert, padded with the sentinel ``num_pairs``) and one BLOCK_N
tile of outputs; blocks past the used ones (their expert id is ``num_experts``) return at once, so
the grid has a static size and the launch is CUDA-graph capturable. At decode each expert sees a few
pairs, so the kernel streams each expert's weight once per block: memory-bound, tiles sized for
small M.

FP8 weights (``FP8``): ``w`` holds float8 codes with dequant scales ``ws`` (E, ⌈rows/S⌉, ⌈K/S⌉) for
S x S blocks (S = ``SCALE_BLOCK``, 128 in lumenrl-quant's blockwise layout). A K tile lies inside one
scale column (BLOCK_K divides S), so each tile's product is scaled per output column:

* w8a16 (``A8`` off): 16-bit activations, the codes widened exactly: ``acc += dot(a, q) * s[n]``;
* w8a8 (``A8``, the ``fp8_block`` scheme): ``a`` holds FP8 codes with 1 x S group scales ``as`` (rows,
  ⌈K/S⌉) (:func:`lumenrl_quant.quantize_fp8`, ``block_size=(1, S)``); the dot runs on FP8 codes
  (FP8 tensor cores, no widening of the weight tile): ``acc += dot(qa, q) * as[r] * s[n]``.

``UPCAST`` (set when Triton's CPU interpreter runs the kernel): 16-bit operands are widened to float32
before ``tl.dot``, because Triton 3.6's interpreter computes bf16 dots wrongly (products of 16-bit
values are exact in float32, so the math is unchanged), and bf16 outputs are rounded to nearest even
explicitly, because its float32 -> bf16 cast truncates; the GPU compiles neither. ``DOT_PRECISION`` is ``ieee`` for float32
activations (no TF32 rounding), else Triton's default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lumenrl_quant.moe import MoETile

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["interpreted", "moe_align_triton", "moe_grouped_gemm"]


if triton is not None:

    @triton.jit
    def _dot_acc(acc, a, w, s, a_s, FP8: tl.constexpr, A8: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        # acc (BM, BN) float32 += a (BM, BK) @ w (BK, BN); FP8: w codes widened exactly, scaled per column s (BN,);
        # A8: a holds FP8 codes too, scaled per row a_s (BM,)
        if A8:
            if UPCAST:  # the interpreter: exact float32 products of the codes
                a, w = a.to(tl.float32), w.to(tl.float32)
            return acc + tl.dot(a, w, input_precision=PREC) * (a_s[:, None] * s[None, :])
        if UPCAST:
            a = a.to(tl.float32)
        if FP8:
            if UPCAST:
                w = w.to(tl.float32)  # the interpreter miscasts E4M3 -> bf16; a is float32 here
            else:
                w = w.to(a.dtype)  # exact: every E4M3 value is a bf16 / fp16 / fp32 value
            return acc + tl.dot(a, w, input_precision=PREC) * s[None, :]
        if UPCAST:
            w = w.to(tl.float32)
        return tl.dot(a, w, acc, input_precision=PREC)

    @triton.jit
    def _round_bf16(x):
        # float32 -> the nearest bfloat16 value (ties to even) as float32, for the interpreter, whose own cast
        # truncates; finite x only
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, w_ptr, ws_ptr, out_ptr, pairs_ptr, block_expert_ptr, route_w_ptr, as_ptr,
        N, num_pairs, num_experts,
        stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om, stride_asm,
        K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr, FP8: tl.constexpr,
        A8: tl.constexpr,
        SCALE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = pid // tiles_n, pid % tiles_n
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:  # past the last used block
            return
        expert = expert.to(tl.int64)
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,) sentinel num_pairs = padding
        valid = pairs < num_pairs
        rows = (pairs // A_ROW_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # (BM, BK)
        w_base = w_ptr + expert * stride_we
        g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # (BK, BN)
        u_ptrs = g_ptrs + N * stride_wn  # GATED: the up half starts at row N
        s_base = ws_ptr + expert * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        s_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                w = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
                w = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if FP8:
                s_g = tl.load(s_base + (offs_n // SCALE_BLOCK) * stride_sn + (k0 // SCALE_BLOCK) * stride_sk,
                              mask=nmask, other=0.0)
            if A8:
                a_s = tl.load(as_ptr + rows * stride_asm + k0 // SCALE_BLOCK, mask=valid, other=0.0)
            acc = _dot_acc(acc, a, w, s_g, a_s, FP8, A8, UPCAST, PREC)
            if GATED:
                if EVEN_K:
                    wu = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
                else:
                    wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                if FP8:
                    s_u = tl.load(s_base + ((N + offs_n) // SCALE_BLOCK) * stride_sn + (k0 // SCALE_BLOCK) * stride_sk,
                                  mask=nmask, other=0.0)
                acc_u = _dot_acc(acc_u, a, wu, s_u, a_s, FP8, A8, UPCAST, PREC)
                u_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_u  # silu(gate) * up, float32
        if ROUTED:
            route = tl.load(route_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            acc = acc * route[:, None]
        if RNE_BF16:
            acc = _round_bf16(acc)
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, S, E: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
        # counts[e] += pairs routed to e among this program's CHUNK pairs (masked lanes go to the spare bin E_P2)
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        inside = offs < S
        experts = tl.where(inside, tl.load(ids_ptr + offs, mask=inside, other=0).to(tl.int32), E_P2)
        hist = tl.histogram(experts, 2 * E_P2)
        bins = tl.arange(0, 2 * E_P2)
        tl.atomic_add(counts_ptr + bins, hist, mask=bins < E)

    @triton.jit
    def _align_blocks_kernel(counts_ptr, cursor_ptr, block_expert_ptr, pairs_ptr, S, NUM_BLOCKS,
                             E: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
        # each program: the padded runs' ends (a cumsum over E), the expert of BLOCK_B blocks, and the
        # sentinel S in their pair slots; program 0 also sets each expert's write cursor to its run's start
        bins = tl.arange(0, E_P2)
        counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        if tl.program_id(0) == 0:
            tl.store(cursor_ptr + bins, ends - padded, mask=bins < E)
        blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)  # runs ended before it
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, E), mask=blocks < NUM_BLOCKS)
        slots = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        sentinel = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.int32) + S
        tl.store(pairs_ptr + slots, sentinel, mask=(blocks < NUM_BLOCKS)[:, None])

    @triton.jit
    def _align_place_kernel(ids_ptr, cursor_ptr, pairs_ptr, S, CHUNK: tl.constexpr):
        # each pair takes the next slot of its expert's run (atomic: the order inside a run is arbitrary, which
        # no result depends on: every row of a block is computed alone)
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        inside = offs < S
        experts = tl.load(ids_ptr + offs, mask=inside, other=0)
        slot = tl.atomic_add(cursor_ptr + experts, 1, mask=inside)
        tl.store(pairs_ptr + slot, offs, mask=inside)


def interpreted() -> bool:
    """True when Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET=1`` before import)."""
    return triton is not None and type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lumenrl_quant.moe.moe_align` in three launches (count, runs and blocks, placement) after one
    memset: the same ``block_experts`` and the same pairs per block (their order inside an expert's run
    may differ: slots are taken atomically)."""
    ids = topk_ids.reshape(-1)
    s, e_p2 = ids.numel(), triton.next_power_of_2(num_experts)
    chunk = min(1024, triton.next_power_of_2(max(s, 16)))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    _align_count_kernel[(triton.cdiv(s, chunk),)](ids, counts, s, E=num_experts, E_P2=e_p2, CHUNK=chunk)
    block_b = 64
    _align_blocks_kernel[(triton.cdiv(num_blocks, block_b),)](counts, cursor, block_experts, pairs, s, num_blocks,
                                                              E=num_experts, E_P2=e_p2, BLOCK_M=block_m, BLOCK_B=block_b)
    _align_place_kernel[(triton.cdiv(s, chunk),)](ids, cursor, pairs, s, CHUNK=chunk)
    return pairs, block_experts


def moe_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    route_weights: torch.Tensor | None,
    *,
    gated: bool,
    a_row_div: int,
    block_m: int,
    tile: MoETile,
    scale_block: int = 128,
    a_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch over every block of ``pairs`` (P,) (``block_experts`` (P / block_m,)): ``out[pair]`` =
    ``silu(a[r] @ w[e, :N].T) * (a[r] @ w[e, N:].T)`` (``gated``, N = rows / 2) or ``route[pair] *
    (a[r] @ w[e].T)`` (``route_weights`` given), with ``r = pair // a_row_div``. Inputs are checked by
    :func:`lumenrl_quant.moe.fused_moe`; ``out`` is written in place and returned. ``a_scale`` (rows,
    ⌈K/scale_block⌉) float32: ``a`` holds FP8 codes (w8a8; FP8 weights only)."""
    if triton is None:
        raise RuntimeError("triton is not installed: pip install lumenrl-quant[triton]")
    num_experts, rows, k = w.shape
    n = rows // 2 if gated else rows
    fp8, a8 = w_scale is not None, a_scale is not None
    if a8 and not fp8:
        raise ValueError("a_scale (FP8 activations) needs FP8 weights with w_scale")
    scale = w_scale if fp8 else out  # any tensor: never read without FP8
    upcast = interpreted() and a.dtype != torch.float32
    grid = (block_experts.numel() * triton.cdiv(n, tile.block_n),)
    _moe_gemm_kernel[grid](
        a, w, scale, out, pairs, block_experts, route_weights if route_weights is not None else out,
        a_scale if a8 else out,  # never read without A8
        n, out.shape[0], num_experts,  # out has one row per pair
        a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0, scale.stride(2) if fp8 else 0,
        out.stride(0), a_scale.stride(0) if a8 else 0,
        K=k, A_ROW_DIV=a_row_div, GATED=gated, ROUTED=route_weights is not None, FP8=fp8, A8=a8,
        SCALE_BLOCK=scale_block, UPCAST=upcast or (a8 and interpreted()), RNE_BF16=upcast and out.dtype == torch.bfloat16,
        PREC="ieee" if a.dtype == torch.float32 or (a8 and interpreted()) else "tf32", EVEN_K=k % tile.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
