"""Triton kernel for the SwiGLU activation of a fused gate/up output, straight to per-token FP8.

``fp8_silu_mul_quantize(gate_up)``: the SwiGLU activation of a fused gate/up output ``(M, 2I)``,
``silu(gate) * up`` in float32, quantized to FP8 with one scale per token, in one launch where
inductor emits three (a split amax, its combine, the cast that recomputes ``h``). At decode batch
sizes (M >= 32) one program per row holds the row in registers (3.96 us against inductor's 6.71 at
Qwen3-8B's 12288 features, M = 64, on an H200). Fewer rows would leave most multiprocessors idle,
so each row is spread over ``split`` programs that meet at a per-row barrier to share their amax:
a sense-reversing semaphore as in inductor's cooperative reductions (no reset between calls), with
the grid bounded so every program is resident.

The plain-torch twin (the reference, and the CPU path) is :func:`lumenrl_quant.fused_mlp.silu_mul_quantize`
with ``backend="torch"``; the kernel's scales equal it (``div_rn``), its codes may differ at rounding ties
(the kernel multiplies by the reciprocal scale and uses a fast exponential).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from lumenrl_quant.formats import fp8_max
from lumenrl_quant.triton_kernels import _next_pow2, _require, _require_pow2, _tl_fp8, _with

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["SILU_SPLIT_MAX_ROWS", "fp8_silu_mul_quantize"]

if triton is not None:

    @triton.jit
    def _silu_mul_quant_kernel(
        gu_ptr, q_ptr, s_ptr, part_ptr, sem_ptr, INTER, stride_gm, stride_qm,
        FP8_MAX: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
        SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
    ):
        # SPLIT programs per row, each over CHUNKS * BLOCK columns: gate = gu[row, :INTER], up =
        # gu[row, INTER:], h = silu(gate) * up in float32. The first BLOCK columns stay in registers;
        # further chunks are read twice (amax pass, then the cast pass recomputes h from L2). With SPLIT > 1
        # the programs of a row exchange their amax through part_ptr behind a barrier on sem_ptr[row]
        # (all programs are resident: the launcher bounds the grid by the multiprocessor count).
        pid = tl.program_id(0)
        row = (pid // SPLIT).to(tl.int64)
        part = pid % SPLIT
        gu_ptr += row * stride_gm
        q_ptr += row * stride_qm
        start = part * (CHUNKS * BLOCK)
        cols = tl.arange(0, BLOCK)
        offs = start + cols
        mask = offs < INTER
        g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + INTER + offs, mask=mask, other=0.0).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        acc = tl.abs(h)
        for c in range(1, CHUNKS):
            offs_c = start + c * BLOCK + cols
            mask_c = offs_c < INTER
            g = tl.load(gu_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + INTER + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(g / (1.0 + tl.exp(-g)) * u))
        amax = tl.max(acc, axis=0)
        if SPLIT > 1:
            tl.store(part_ptr + row * SPLIT + part, amax)
            tl.debug_barrier()
            # sense-reversing barrier (as inductor's cooperative reductions): the arrivals of one
            # round sum to 2**31, flipping the top bit of the semaphore, which needs no reset
            one = tl.full([], 1, tl.int32).to(tl.uint32)
            if part == 0:
                add = 0x80000000 - (tl.full([], SPLIT, tl.int32).to(tl.uint32) - one)
            else:
                add = one
            old = tl.atomic_add(sem_ptr + row, add, sem="release")
            flipped = False
            while not flipped:
                now = tl.atomic_add(sem_ptr + row, 0, sem="acquire")
                flipped = ((old ^ now) & 0x80000000) != 0
            tl.debug_barrier()
            slots = tl.arange(0, SPLIT_P2)
            parts = tl.load(part_ptr + row * SPLIT + slots, mask=slots < SPLIT, other=0.0, volatile=True)
            amax = tl.max(parts, axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        inv = tl.math.div_rn(1.0, scale)
        if part == 0:
            tl.store(s_ptr + row, scale)
        q = tl.minimum(tl.maximum(h * inv, -FP8_MAX), FP8_MAX)  # the first chunk, still in registers
        tl.store(q_ptr + offs, q.to(OUT), mask=mask)
        for c in range(1, CHUNKS):  # the others reloaded (L2) and recomputed
            offs_c = start + c * BLOCK + cols
            mask_c = offs_c < INTER
            g = tl.load(gu_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + INTER + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(g / (1.0 + tl.exp(-g)) * u * inv, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + offs_c, q.to(OUT), mask=mask_c)


def _silu_defaults(m: int, inter: int) -> dict:
    # H200, Qwen3-8B (I = 12288), M = 64, bench_fused_mlp.py: one program per row with the row in
    # registers (16 warps) beat splitting it and inductor's three kernels. Fewer rows than that leave
    # most multiprocessors idle: split them.
    if m >= 32:
        block = min(_next_pow2(inter), 16384)
        return {"block": block, "num_warps": 16 if block >= 8192 else 8 if block >= 2048 else 4, "split": 1}
    return {"block": min(_next_pow2(inter), 4096), "num_warps": 8, "split": 4}


_SEMAPHORES: dict[tuple[int, int], torch.Tensor] = {}
SILU_SPLIT_MAX_ROWS = 4096  # rows that can take the split (multi-program) form; semaphores per (device, stream)


def _semaphores(device: torch.device) -> torch.Tensor:
    """Barrier semaphores of the split kernel, one per row, zero once and reused forever (the barrier
    needs no reset). Kept per (device, stream): kernels on two streams at once must not share a row's."""
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    if key not in _SEMAPHORES:
        _SEMAPHORES[key] = torch.zeros(SILU_SPLIT_MAX_ROWS, dtype=torch.uint32, device=device)
    return _SEMAPHORES[key]


def _resident_programs(device: torch.device, num_warps: int) -> int:
    """Programs that surely fit on the GPU at once: one per multiprocessor per 16 warps (of 64)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return sms * max(1, 16 // num_warps)


def fp8_silu_mul_quantize(
    gate_up: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = silu(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)`` (``gate_up`` (M, 2I), any float
    dtype), computed in float32 and quantized with one scale per row: ``(codes (M, I), scales (M, 1))``.

    ``config`` overrides ``block`` (columns per pass, a power of two), ``num_warps`` and ``split``
    (programs per row, which meet at a barrier to share the row amax; reduced so that the grid stays
    resident, and 1 in Triton's interpreter, which runs programs one after another)."""
    _require(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up shape {tuple(gate_up.shape)}; allowed: (M, 2 * I)")
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    cfg = _with(_silu_defaults(m, inter), config)
    _require_pow2("config block", cfg["block"], 16)
    _require_pow2("config split", cfg["split"])
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    q = torch.empty((m, inter), dtype=dtype, device=gate_up.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=gate_up.device)
    if not m:
        return q, s
    split = cfg["split"]
    if os.environ.get("TRITON_INTERPRET") == "1" or m > SILU_SPLIT_MAX_ROWS:
        split = 1
    else:
        split = max(1, min(split, _resident_programs(gate_up.device, cfg["num_warps"]) // m))
        split = 1 << (split.bit_length() - 1)  # a power of two
    span = -(-inter // split)  # columns per program
    block = min(cfg["block"], _next_pow2(span))
    chunks = -(-span // block)
    split = -(-inter // (chunks * block))  # no program without columns
    part = torch.empty((m, split), dtype=torch.float32, device=gate_up.device) if split > 1 else s
    sem = _semaphores(gate_up.device) if split > 1 else s
    _silu_mul_quant_kernel[(m * split,)](
        gate_up, q, s, part, sem, inter, gate_up.stride(0), q.stride(0), FP8_MAX=fp8_max(dtype), OUT=_tl_fp8(dtype),
        BLOCK=block, CHUNKS=chunks, SPLIT=split, SPLIT_P2=_next_pow2(split), num_warps=cfg["num_warps"],
    )
    return q, s
