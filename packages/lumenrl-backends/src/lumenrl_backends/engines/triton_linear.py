"""Decode-sized linear layers in Triton, for the native engine: ``x @ w.T`` at M <= 128 rows, optionally
with the SwiGLU ``silu(gate) * up`` in the epilogue, optionally chained by programmatic dependent launch.

Why: at decode the batch (M) is 1..128 while N and K are the model's widths, so a linear reads its
weight once and is bandwidth-bound. What separates a kernel from the copy bandwidth is its start and
its end: the pipeline fills from DRAM while nothing streams, the last programs drain while the next
kernel has not started, and a decode step runs hundreds of such kernels; cuBLAS's split-K down
projection adds a reduce kernel. The measured figures are the ``decode_linear`` entry of
``benchmarks/RESULTS.md`` and ``docs/decisions/0023-decode-gemm-and-pdl.md``. This kernel does three
things about it:

* **PDL** (``pdl=True``, CUDA sm90+): the kernel is launched with programmatic stream serialization.
  Each program first issues L2 prefetches of the first ``prefetch`` columns of its weight rows (weights
  do not depend on the previous kernel), then waits for the previous kernel (``griddepcontrol.wait``:
  its completion and memory flush), then lets the next kernel launch (``launch_dependents``). So the
  weight stream starts while the previous kernel drains, and launches overlap. Correctness needs only
  that every PDL kernel of the chain waits before it reads anything a previous kernel wrote and
  triggers its dependents only after that wait; this kernel and inductor's PDL kernels do both, and a
  kernel launched without PDL serializes as usual.
* **SwiGLU epilogue** (``swiglu=True``): ``w`` is the fused ``cat([gate, up])`` weight (2I, K); a
  program owns ``BLOCK_N`` features of both halves (two accumulators) and writes ``silu(gate) * up``
  (M, I): no (M, 2I) intermediate and no separate elementwise kernel.
* **Tiles for the shape**: one program per ``BLOCK_N`` output features walks all of K (no split-K, so
  no reduce kernel and a deterministic sum order); tiles and pipeline depth per shape from a sweep
  (:data:`TUNED`, :func:`config_for`). Rows come in tiles of up to :data:`TILE_M` (64); past 64 rows a
  second program takes the next 64 rows of the same weight tile, launched right after the first, so the
  pair runs side by side and the weight streams from HBM once (the second read hits L2).

``tma=True`` (or a launch configuration's ``"tma": 1``; sm90+) copies the x and weight tiles with the tensor
memory accelerator through host tensor descriptors instead of pointer loads: the same tiles in the same order, so
the same bits; measured level with pointer loads on an H100 (decision 0023), so off by default.

Numerics: float32 accumulation (``tl.dot`` of bf16/fp16 operands), the bias added in float32, one
rounding to the output dtype; with ``swiglu`` gate and up are first rounded to the model dtype (as the
unfused GEMM's outputs are), then ``silu(gate) * up`` is taken in float32 and rounded once (what
inductor's fused kernel for ``act_fn(gate) * up`` does). Versus cuBLAS only the summation order differs.
:func:`reference_decode_linear` is the float32 torch reference (the tests'); where the kernel does not run, the
op runs :func:`torch_linear` (cuBLAS on CUDA).

Exposed as the custom op ``lumenrl::decode_linear`` (opaque to ``torch.compile``, safe in CUDA-graph
capture); it picks kernel or cuBLAS by the row count itself, so a compiled caller is not specialised on the
batch. Requirements (checked by :func:`supported`): 2-D ``x`` with M <= :data:`MAX_M`, contiguous
``w`` (N, K) of ``x``'s dtype (bf16/fp16), K a multiple of ``BLOCK_K``, N of ``BLOCK_N`` (and I for
``swiglu``). In Triton's CPU interpreter (tests) float32 -> bf16 casts truncate, so the kernel rounds
the bits itself there; PDL and prefetch are CUDA-only and off in the interpreter.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["AUTO_MAX_M", "AUTO_MIN_M", "INTERPRETED", "MAX_M", "PDL_PREFETCH", "TILE_M", "TUNED", "TUNED_ROWS", "auto_rows", "config_for", "decode_linear", "inductor_pdl_options", "pdl_supported", "reference_decode_linear", "rms_norm", "supported", "torch_linear", "tuned", "weight_reason"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None

from lumenrl_backends.engines.triton_pdl import launch_options, pdl_supported
from lumenrl_backends.engines.triton_rope import rms_norm  # transformers' RMSNorm (the torch path's norm)
from lumenrl_quant.triton_gemm import TensorDescriptor, tma_reason  # TMA copies: the FP8 GEMM's checks

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton does at import
TILE_M = 64  # rows per program: the tile measured at M = 64 (the benchmark's decode batch)
MAX_M = 128  # up to two row tiles (each program pair of one weight tile runs side by side: one weight read)
PDL_PREFETCH = 512  # weight columns (1 KB of a bf16 row) a PDL launch prefetches to L2 before it waits
AUTO_MIN_M, AUTO_MAX_M = 33, 64  # decode_linear="auto": 33..64 rows (one 64-row tile) unless TUNED_ROWS says; "on": 1..128
_DTYPES = (torch.bfloat16, torch.float16)


def inductor_pdl_options(pdl: bool) -> dict[str, bool] | None:
    """``torch.compile`` options that make inductor's Triton kernels launch with PDL (``pdl`` and a torch
    whose inductor has ``triton.enable_pdl``), else None."""
    from torch._inductor import config

    return {"triton.enable_pdl": True} if pdl and hasattr(config.triton, "enable_pdl") else None


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


# (N, K, swiglu) -> launch parameters, tuned on an H200 (``bench_decode_linear.py --tune``; times in its history
# entry) at the rows of :data:`TUNED_ROWS`. Other shapes take :func:`config_for`'s rule.
TUNED: dict[tuple[int, int, bool], dict[str, int]] = {
    # fused Qwen3-8B shapes, M = 64 (the decode benchmark's batch)
    (6144, 4096, False): {"block_n": 64, "block_k": 128, "num_stages": 5, "num_warps": 4},  # q/k/v
    (4096, 4096, False): {"block_n": 32, "block_k": 128, "num_stages": 6, "num_warps": 4},  # o
    (12288, 4096, True): {"block_n": 32, "block_k": 64, "num_stages": 4, "num_warps": 4},  # gate/up + SwiGLU
    (4096, 12288, False): {"block_n": 32, "block_k": 128, "num_stages": 6, "num_warps": 4},  # down
    # fused Qwen3-0.6B shapes, M = 128 (the GRPO benchmark's rollout: 16 prompts x 8)
    (4096, 1024, False): {"block_n": 64, "block_k": 128, "num_stages": 5, "num_warps": 4},  # q/k/v
    (1024, 2048, False): {"block_n": 32, "block_k": 128, "num_stages": 5, "num_warps": 4},  # o
    (3072, 1024, True): {"block_n": 64, "block_k": 64, "num_stages": 5, "num_warps": 8},  # gate/up + SwiGLU
    (1024, 3072, False): {"block_n": 32, "block_k": 128, "num_stages": 5, "num_warps": 4},  # down
}
# rows decode_linear="auto" routes for a tuned shape: the row tiles it was measured at (one 64-row tile: 33..64;
# two: 65..128); shapes not listed: AUTO_MIN_M..AUTO_MAX_M
TUNED_ROWS: dict[tuple[int, int, bool], tuple[int, int]] = {
    (4096, 1024, False): (65, 128), (1024, 2048, False): (65, 128), (3072, 1024, True): (65, 128),
    (1024, 3072, False): (65, 128),
}


def auto_rows(n: int, k: int, *, swiglu: bool = False) -> tuple[int, int]:
    """(min_m, max_m): the rows ``decode_linear="auto"`` sends to the kernel for a tuned (N, K) weight (N: output
    features; with ``swiglu`` the I gate features): the rows its launch parameters were measured at."""
    return TUNED_ROWS.get((n, k, swiglu), (AUTO_MIN_M, AUTO_MAX_M))


def tuned(n: int, k: int, device: torch.device, *, swiglu: bool = False) -> bool:
    """Whether (N, K) has measured launch parameters (:data:`TUNED`) for ``device``: a CUDA device with
    the H200's 132 multiprocessors."""
    return (n, k, swiglu) in TUNED and device.type == "cuda" and _sms(device) == 132


def config_for(n: int, k: int, device: torch.device, *, swiglu: bool = False) -> dict[str, int]:
    """Launch parameters for an (N, K) weight (N: the output features; with ``swiglu`` the I gate
    features): :data:`TUNED` where measured, else a rule from the same sweep: 32-feature tiles (at
    M = 64 the weight tile is the bytes in flight, and narrow tiles give many programs), 128 only
    where that still leaves ~1.5 programs per multiprocessor (an lm head); ``block_k`` 128 (64 for
    SwiGLU's two tiles); as many pipeline stages as ~200 KB of shared memory holds, at most 6."""
    if tuned(n, k, device, swiglu=swiglu):
        return dict(TUNED[(n, k, swiglu)])
    operands = 2 if swiglu else 1  # swiglu: gate and up tiles per stage
    block_n = 128 if n // 128 >= 1.5 * _sms(device) else 32
    block_k = 64 if swiglu else 128
    while k % block_k and block_k > 32:
        block_k //= 2
    stage_bytes = (TILE_M + operands * block_n) * block_k * 2
    stages = max(2, min(6, 200_000 // stage_bytes))
    return {"block_n": block_n, "block_k": block_k, "num_stages": stages, "num_warps": 8 if block_n >= 128 else 4}


if triton is not None:
    # float32 -> dtype to nearest even, also in the interpreter (which truncates float32 -> bf16)
    from lumenrl_backends.engines.triton_pdl import prefetch_l2, wait_then_release
    from lumenrl_backends.engines.triton_rope import _round

    @triton.jit
    def _operand(x, EMULATED: tl.constexpr):
        """A dot operand: as loaded on GPUs; float32 in the interpreter, whose bf16 ``tl.dot`` multiplies
        raw bits (Triton 3.6). A product of two 16-bit values is exact in float32, so only the sum order
        can differ from the GPU's."""
        if EMULATED:
            return x.to(tl.float32)
        return x

    @triton.jit
    def _prefetch_rows(w_ptr, rows, stride_wn, COLS: tl.constexpr, LINE: tl.constexpr):
        """L2 prefetches of the first ``COLS`` columns of each row in ``rows`` (one per 128-byte line)."""
        lines = tl.arange(0, COLS // LINE) * LINE
        prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + lines[None, :])

    @triton.jit
    def _decode_linear_kernel(
        x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, part_ptr, count_ptr, x_desc, w_desc, M, M_TILES, HALF,
        stride_xm, stride_wn, stride_rm, stride_om, eps, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
        RESIDUAL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
        EMULATED: tl.constexpr, TMA: tl.constexpr,
    ):
        # row tiles of one weight tile are neighbours in launch order: they run side by side and the second
        # finds the weight in L2 (one HBM read of the weight for up to MAX_M rows); then the K splits
        pid = tl.program_id(0)
        pid_m, pid_s, pid_n = pid % M_TILES, pid // M_TILES % SPLIT, pid // (M_TILES * SPLIT)
        k_start = pid_s * (K // SPLIT)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        if PREFETCH > 0:  # the weight does not depend on the previous kernel: start streaming it now
            _prefetch_rows(w_ptr + k_start, offs_n, stride_wn, PREFETCH, LINE)
            if SWIGLU:
                _prefetch_rows(w_ptr + k_start, offs_n + HALF, stride_wn, PREFETCH, LINE)
        wait_then_release(PDL)  # the previous kernel's writes (x) are visible from here (triton_pdl)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        tl.static_assert(SPLIT == 1 or not NORM, "the norm needs the row's whole sum of squares: no split-K")
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SwiGLU's up half (unused otherwise)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the norm's sums of squares (unused otherwise)
        if SWIGLU:
            u_ptrs = w_ptr + (offs_n + HALF).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        if NORM:  # RMSNorm of x: the row's sum of squares gathered along K, x * g as the operand, rstd at the end
            g_ptrs = g_ptr + offs_k
        for k_off in range(0, K // SPLIT, BLOCK_K):
            kk = k_start + k_off
            if TMA:  # tensor-memory-accelerator copies of the tiles (rows past M read as zeros)
                x = x_desc.load([pid_m * BLOCK_M, kk])
            else:
                x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
                x = _round(xf * tl.load(g_ptrs).to(tl.float32)[None, :], x_ptr.dtype.element_ty, EMULATED)
                g_ptrs += BLOCK_K
            x = _operand(x, EMULATED)
            if TMA:
                w = w_desc.load([pid_n * BLOCK_N, kk])
            else:
                w = tl.load(w_ptrs)
            acc = tl.dot(x, tl.trans(_operand(w, EMULATED)), acc)
            if SWIGLU:
                if TMA:
                    u = w_desc.load([HALF + pid_n * BLOCK_N, kk])
                else:
                    u = tl.load(u_ptrs)
                acc_u = tl.dot(x, tl.trans(_operand(u, EMULATED)), acc_u)
                u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SPLIT > 1:  # every split leaves its float32 sums; the last to arrive adds them in split order
            acc, acc_u, last = _split_reduce(acc, acc_u, part_ptr, count_ptr,
                                             pid_n * M_TILES + pid_m, pid_s, SPLIT, BLOCK_M, BLOCK_N, SWIGLU)
            if last:
                _epilogue(acc, acc_u, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mmask, HALF,
                          stride_rm, stride_om, eps, K, HAS_BIAS, SWIGLU, NORM, RESIDUAL, EMULATED)
        else:
            _epilogue(acc, acc_u, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mmask, HALF,
                      stride_rm, stride_om, eps, K, HAS_BIAS, SWIGLU, NORM, RESIDUAL, EMULATED)

    @triton.jit
    def _split_reduce(acc, acc_u, part_ptr, count_ptr, tile, pid_s, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
        """Split-K without a second kernel, deterministically: each split stores its float32 partial sums, then
        counts itself in on the tile's counter (release: after a CTA barrier, so every thread's stores are
        ordered before it); the program that counts last (acquire) sums the partials in split order 0..S-1,
        whichever program that is, so the bits do not depend on which split finished last, and resets the
        counter to 0 for the next launch (which, under PDL, touches it only after this kernel completed)."""
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = part_ptr + tile.to(tl.int64) * (SPLIT * (2 if SWIGLU else 1) * tile_elems)
        tl.store(base + pid_s * tile_elems + offs, acc)
        if SWIGLU:
            tl.store(base + (SPLIT + pid_s) * tile_elems + offs, acc_u)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        tl.debug_barrier()
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # L2 loads (.cg): other multiprocessors wrote these
                acc += tl.load(base + s * tile_elems + offs, cache_modifier=".cg")
                if SWIGLU:
                    acc_u += tl.load(base + (SPLIT + s) * tile_elems + offs, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        return acc, acc_u, last

    @triton.jit
    def _epilogue(acc, acc_u, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mmask, HALF, stride_rm, stride_om, eps,
                  K: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                  RESIDUAL: tl.constexpr, EMULATED: tl.constexpr):
        dt = out_ptr.dtype.element_ty
        if NORM:  # (x * rstd * g) @ w.T = rstd * ((x * g) @ w.T): the row's scale after the sum
            rstd = tl.math.rsqrt(ss / K + eps)[:, None]
            acc = acc * rstd
            if SWIGLU:
                acc_u = acc_u * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
            if SWIGLU:
                acc_u += tl.load(b_ptr + HALF + offs_n).to(tl.float32)[None, :]
        if SWIGLU:  # gate and up rounded as the unfused GEMM outputs are, then silu(gate) * up in float32
            gate = _round(acc, dt, EMULATED).to(tl.float32)
            up = _round(acc_u, dt, EMULATED).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up
        if RESIDUAL:  # the layer's residual add: the GEMM output rounded as the unfused one is, then + residual
            res = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mmask[:, None], other=0.0)
            acc = _round(acc, dt, EMULATED).to(tl.float32) + res.to(tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, _round(acc, dt, EMULATED), mask=mmask[:, None])


def reference_decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            swiglu: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                            residual: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of the kernel's numerics: float32 GEMM (+ bias), one rounding; ``swiglu`` rounds gate
    and up first; ``norm_weight``: the operand is ``x * g`` rounded to x's dtype and the float32 row scale
    ``rsqrt(mean(x^2) + eps)`` multiplies the sum; ``residual``: the output rounded, plus the residual, rounded."""
    if norm_weight is not None:
        x32 = x.float()
        operand = (x32 * norm_weight.float()).to(x.dtype).float()
        out = (operand @ weight.float().T) * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    else:
        out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    if swiglu:
        gate, up = out.to(x.dtype).float().chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    if residual is not None:
        out = out.to(x.dtype).float() + residual.float()
    return out.to(x.dtype)


def weight_reason(weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False, *,
                  tuned_only: bool = False) -> str | None:
    """None when the kernel takes this weight (and bias) for decode-sized inputs of its dtype, else why not;
    ``tuned_only``: also only where the shape has measured launch parameters (:func:`tuned`)."""
    if triton is None:
        return "triton is not installed"
    if weight.dim() != 2 or weight.dtype not in _DTYPES or (bias is not None and bias.dtype != weight.dtype):
        return f"weight {tuple(weight.shape)} {weight.dtype}; allowed: 2-D, one of {_DTYPES} (bias alike)"
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return "weight (and bias) must be contiguous"
    n, k = weight.shape
    if swiglu and n % 2:
        return f"swiglu needs an even N (cat([gate, up])); got {n}"
    cfg = config_for(n // 2 if swiglu else n, k, weight.device, swiglu=swiglu)
    if k % (cfg["block_k"] * cfg.get("split", 1)) or (n // 2 if swiglu else n) % cfg["block_n"]:
        return (f"(N, K)=({n}, {k}) not a multiple of the tile ({cfg['block_n']}, {cfg['block_k']}"
                f" x {cfg.get('split', 1)} K splits)")
    if not (weight.is_cuda or INTERPRETED):
        return f"device {weight.device.type}: the kernel runs on CUDA (or in Triton's interpreter)"
    if tuned_only and not tuned(n // 2 if swiglu else n, k, weight.device, swiglu=swiglu):
        return f"(N, K)=({n}, {k}): no measured launch parameters for this device (decode_linear='on' takes it)"
    return None


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
              norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> str | None:
    """None when :func:`decode_linear` runs the kernel for these operands, else the reason it does not."""
    if x.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        return f"need x (M, K) and weight (N, K); got {tuple(x.shape)}, {tuple(weight.shape)}"
    if x.shape[0] > MAX_M:
        return f"M={x.shape[0]} > {MAX_M}"
    if x.dtype != weight.dtype or x.device != weight.device or x.stride(-1) != 1:
        return f"x {x.dtype} on {x.device} with last stride {x.stride(-1)}; need the weight's dtype and device, unit stride"
    for name, t in (("norm_weight", norm_weight), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1):
            return f"{name} {t.dtype} on {t.device} with last stride {t.stride(-1)}; need x's dtype and device, unit stride"
    return weight_reason(weight, bias, swiglu)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Split-K arrival counters: int32 zeros, which every launch leaves at zero (its last program per tile resets
    the tile's counter). One buffer per device and thread: the kernels one thread launches run one after the
    other (its eager step, then its graph capture and replays), while two threads (an async trainer's
    rollouter and trainer) may launch at once. Created outside CUDA-graph capture (a capture replays kernels,
    never allocations): the engine's graphs run each step eagerly before capturing it."""
    key = (device, threading.get_ident())
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_linear: split-K counters must exist before CUDA-graph capture; run the GEMM "
                               "once outside the capture first")
        buf = _COUNTERS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool, pdl: bool,
            prefetch: int, config: dict[str, int] | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, residual: torch.Tensor | None = None, tma: bool | None = None) -> torch.Tensor:
    """One launch (no checks: :func:`supported` first); ``config`` overrides :func:`config_for` (the
    benchmark's sweep; its ``"tma"`` key: tiles copied by TMA); ``tma`` (not None) overrides the configuration's
    ``"tma"``."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    cfg = config or config_for(n, k, x.device, swiglu=swiglu)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl, extra = launch_options(pdl, x.device)
    line = 128 // weight.element_size()
    prefetch = min(prefetch, k) // line * line if pdl else 0
    prefetch = triton.next_power_of_2(prefetch) if prefetch else 0
    block_m = max(16, triton.next_power_of_2(min(m, TILE_M)))
    m_tiles = triton.cdiv(m, block_m)
    tiles = n // cfg["block_n"] * m_tiles
    split = 1 if norm_weight is not None else cfg.get("split", 1)  # the norm needs whole rows: no split
    if split > 1:  # the splits' float32 partial sums (stay in L2) and the per-tile arrival counters
        parts = torch.empty(tiles * split * (2 if swiglu else 1) * block_m * cfg["block_n"], dtype=torch.float32,
                            device=x.device)
        counts = _counters(x.device, tiles)
    else:
        parts = counts = out
    x_desc = w_desc = None
    if (cfg.get("tma") if tma is None else tma) and tma_reason(x, weight) is None:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, cfg["block_k"]])
        w_desc = TensorDescriptor.from_tensor(weight, [cfg["block_n"], cfg["block_k"]])
    _decode_linear_kernel[(tiles * split,)](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, out, parts, counts, x_desc, w_desc, m, m_tiles, n, x.stride(0),
        weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), float(eps), K=k,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SPLIT=split, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, NORM=norm_weight is not None, RESIDUAL=residual is not None, PDL=pdl,
        PREFETCH=prefetch if prefetch <= k else 0, LINE=line, EMULATED=INTERPRETED, TMA=w_desc is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )
    return out


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 swiglu: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """What the op runs where the kernel does not: ``F.linear`` (cuBLAS on CUDA); with ``swiglu``,
    ``silu(gate) * up`` taken in float32 from the rounded gate and up and rounded once (as inductor's fused
    kernel for the unfused module's ``act_fn(gate) * up`` does); ``norm_weight``: transformers' RMSNorm of x
    first (:func:`rms_norm`); ``residual``: added to the rounded output (the decoder layer's ``residual + h``)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    out = torch.nn.functional.linear(x, weight, bias)
    if swiglu:
        gate, up = out.float().chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return out if residual is None else residual + out


def _op_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool, pdl: bool,
             prefetch: int, min_m: int, max_m: int = MAX_M, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None, tma: bool = False) -> torch.Tensor:
    # the row-count choice is made here, outside the traced graph: no guard on the batch, no recompile
    if min_m <= x.shape[0] <= max_m and supported(x, weight, bias, swiglu, norm_weight, residual) is None:
        return _launch(x, weight, bias, swiglu, pdl, prefetch, norm_weight=norm_weight, eps=eps, residual=residual,
                       tma=tma)
    return torch_linear(x, weight, bias, swiglu, norm_weight, eps, residual)


def _op_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool, pdl: bool,
             prefetch: int, min_m: int, max_m: int = MAX_M, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None, tma: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0]))


def _register():  # noqa: ANN202 - a torch.library CustomOpDef
    """``lumenrl::decode_linear``, registered at import (a registration inside a compiled region would
    break the graph), once per process; without Triton it runs the torch reference."""
    op = getattr(torch.ops.lumenrl, "decode_linear", None)
    if op is None:
        op = torch.library.custom_op("lumenrl::decode_linear", mutates_args=())(_op_impl)
        op.register_fake(_op_fake)
    return op


_OP = _register()


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, swiglu: bool = False,
                  pdl: bool = False, prefetch: int = PDL_PREFETCH, min_m: int = 1, max_m: int = MAX_M,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  residual: torch.Tensor | None = None, tma: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` (M, K); with ``swiglu``, ``weight`` = ``cat([gate, up])`` (2I, K)
    and the result is ``silu(gate) * up`` (M, I). The kernel runs for ``min_m`` <= M <= ``max_m`` (at most
    :data:`MAX_M`: rows beyond one :data:`TILE_M` tile take a second program per weight tile) on
    operands it takes (:func:`supported`); anything else runs :func:`torch_linear` (cuBLAS on CUDA). The
    choice is made inside the op, so a compiled caller is not specialised on M. ``pdl``: launch with
    programmatic dependent launch where supported (CUDA sm90+), prefetching the first ``prefetch`` columns
    of each weight row to L2 before waiting for the previous kernel.

    ``norm_weight`` (K,): the GEMM's input is ``RMSNorm(x)`` with this weight and ``eps`` (the decoder layer's
    norm before q/k/v or gate/up): the kernel gathers each row's sum of squares while it streams K and scales the
    sum at the end (:func:`reference_decode_linear`), so no separate norm kernel runs. ``residual`` (M, N): the
    result is ``residual + (x @ weight.T)`` (the layer's residual add after o or down), rounded as the unfused
    add is. ``tma``: the kernel copies its tiles with the tensor memory accelerator where :func:`tma_reason`
    allows (sm90+; the same bits as pointer loads)."""
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu=True needs weight = cat([gate, up]) with an even row count; got {tuple(weight.shape)}")
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch}; allowed: an int >= 0 (weight columns)")
    if min_m < 1:
        raise ValueError(f"min_m={min_m}; allowed: an int >= 1")
    if not min_m <= max_m <= MAX_M:
        raise ValueError(f"max_m={max_m}; allowed: an int in min_m..{MAX_M} (min_m={min_m})")
    if norm_weight is not None and tuple(norm_weight.shape) != (weight.shape[-1],):
        raise ValueError(f"norm_weight shape {tuple(norm_weight.shape)}; allowed: ({weight.shape[-1]},), the weight's K")
    if not eps >= 0:
        raise ValueError(f"eps={eps}; allowed: a float >= 0")
    out_shape = (x.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0])
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"residual shape {tuple(residual.shape)}; allowed: {out_shape}, the output's shape")
    # eager and under CUDA graph capture, the implementation itself: torch.library's dispatch costs more host time
    # than the launch (the engine's capture passes); the registered op where torch.compile traces
    op = _OP if torch.compiler.is_compiling() else _op_impl
    return op(x, weight, bias, swiglu, pdl, prefetch, min_m, max_m, norm_weight, float(eps), residual, bool(tma))
