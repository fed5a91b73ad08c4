"""Scaled FP8 GEMM with one entry point that picks the fastest correct path.

Design
------
``scaled_mm(a_q, a_scale, b_q, b_scale)`` computes ``out = (a_q * a_scale) @ (b_q * b_scale).T``
with ``a`` the activation ``(M, K)`` and ``b`` the weight ``(N, K)`` (nn.Linear layout), both FP8,
and dequant scales in the convention of :mod:`lumenrl_quant.fp8`. The scale layout is inferred
from the scale shapes (or given by ``a_block_size`` / ``b_block_size``):

=========================  ========================  ==============================
mode                       a_scale                   b_scale
=========================  ========================  ==============================
tensorwise                 ``()`` / one element      ``()`` / one element
rowwise                    ``(M, 1)``                ``(N, 1)``
blockwise (DeepSeek-V3)    ``(M, ⌈K/128⌉)`` 1x128    ``(⌈N/128⌉, ⌈K/128⌉)`` 128x128
other combinations         any of the above, mixed   -> always emulated
=========================  ========================  ==============================

Paths (:func:`gemm_path` names the one that would run):

* ``scaled_mm_<mode>``: ``torch._scaled_mm`` where device and torch support the mode: CUDA
  sm89+ and ROCm for tensorwise / rowwise, CUDA sm90 for blockwise (needs K % 128 == 0). Not on
  CPU: torch 2.13's CPU tensorwise ``_scaled_mm`` is correct but measured ~500-1000x slower than
  the emulation (16x256x256: 245 ms vs 0.55 ms), so CPU always emulates. ``torch._scaled_mm`` wants mat2 column-major (we pass ``b.t()``), K and N multiples
  of 16, float32 scales; rowwise output must be bfloat16 on CUDA. Blockwise 1x128 activation scales
  go in "outer-dim-major" layout (stride ``(1, M)``), 128x128 weight scales as ``b_scale.t()``.
* ``triton_blockwise``: the optional Triton kernel (:mod:`lumenrl_quant.triton_kernels`) for
  blockwise on CUDA sm89+, used for decode shapes where the H200 benchmark shows it beats cuBLAS
  (``M <= TRITON_BLOCKWISE_MAX_M`` and ``K <= TRITON_BLOCKWISE_MAX_K``), for M < 4 (cuBLASLt has no
  blockwise kernel there) and wherever cuBLAS has no blockwise mode at all (sm89, older torch).
* ``scaled_mm_rowwise_epilogue``: rowwise scales at decode sizes (``M <= ROWWISE_EPILOGUE_MAX_M``):
  torch's sm90 rowwise ``_scaled_mm`` (a CUTLASS kernel tiled for large M) is no faster than BF16
  at M <= 128 (13.9 vs 12.4 us at 64x4096x4096, RESULTS.md) while cuBLAS *tensorwise* is 1.6-1.9x
  BF16. Rowwise scales factor out of the sum (``out[m, n] = sa[m] sb[n] sum_k a_q b_q``), so this
  path runs the tensorwise GEMM with unit scales into float32 and applies ``sa * sb`` (+ bias)
  in an elementwise epilogue (which ``torch.compile`` fuses into the next op). Same math as the
  rowwise kernel up to float32 rounding of the epilogue. Eager (CUDA-graph mode) the epilogue
  is one small Triton kernel (``acc * sa * sb (+ bias)`` -> ``out_dtype``) when Triton is there.
* ``emulated``: dequantize both operands to float32, matmul in float32, add bias, cast. This is
  the exact reference (float32 accumulation), used on CPU and wherever no fast path exists.

A tensorwise ``()`` scale next to a rowwise one (a 1-row activation's ``(1, 1)`` scale is both)
runs as rowwise: the scalar is broadcast. (Before, M = 1 fp8_row activations were read as
tensorwise, the mix had no fast mode and M = 1 decode fell back to the float32 emulation:
the 136 / 423 us "M = 1 anomaly" of RESULTS.md.)

:func:`run_gemm_path` executes a named path with no checks, no fallback and no Python-side
state: it is what a ``torch.compile``-d forward calls (dynamo traces it without graph breaks)
after choosing the path once, outside the compiled region, with :func:`gemm_path`.

If a fast path raises at runtime (an older torch that lacks a mode), the combination is
remembered (:func:`note_gemm_failure`, one warning) and the next best path runs instead (e.g. the
rowwise kernel for the rowwise epilogue), finally the emulation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lumenrl_quant.formats import fp8_format
from lumenrl_quant.fp8 import dequantize_fp8

__all__ = [
    "GemmPath", "ScaleLayout", "as_dtype", "emulated_scaled_mm", "gemm_path", "infer_scale_layout", "run_gemm_path", "scaled_mm",
]

GemmPath = str  # "scaled_mm_<tensorwise|rowwise|rowwise_epilogue|blockwise>" | "triton_<blockwise|rowwise>" | "emulated"

# Blockwise GEMMs with M <= TRITON_BLOCKWISE_MAX_M and K <= TRITON_BLOCKWISE_MAX_K use the Triton
# kernel instead of cuBLAS. Measured on H200 (benchmarks/RESULTS.md, CUDA-graph replay): Triton
# 12.3-13.0 us vs cuBLAS 16.1-16.6 us at 4096x4096 and 20.6-21.1 vs 22.6-23.1 us at N=14336, K=4096
# for M = 4..16; cuBLAS wins at K = 14336 (29 vs 39 us) and for M >= 32.
TRITON_BLOCKWISE_MAX_M = 16
TRITON_BLOCKWISE_MAX_K = 8192
# cuBLASLt (H200, torch 2.11 / CUDA 13.0) has no blockwise heuristic for M < 4: it raises
# CUBLAS_STATUS_NOT_SUPPORTED at M = 1 and 2 (measured), so those go to Triton (or emulation).
CUBLAS_BLOCKWISE_MIN_M = 4
# Rowwise GEMMs with M <= ROWWISE_EPILOGUE_MAX_M run as a unit-scale cuBLAS tensorwise GEMM into
# float32 plus a scale epilogue (see the module doc; 0 disables). At M = 256 the tensorwise GEMM is
# still 11 vs 14.3 us (4096^2); training-sized M keeps the single rowwise kernel.
ROWWISE_EPILOGUE_MAX_M = 256
# Rowwise GEMMs with M <= TRITON_ROWWISE_MAX_M whose (N, K) has a tuned launch configuration in
# ``TRITON_ROWWISE_CONFIGS`` run the Triton split-K kernel (:mod:`lumenrl_quant.triton_gemm`) where
# it beat cuBLAS in ``benchmarks/quant/bench_decode_gemm.py --tune`` (RESULTS.md); 0 disables.
# On an H200 at M = 64 Triton wins at Qwen3-8B's fused q/k/v and gate/up shapes. At its o and down shapes,
# timed alone, the kernel (best tiles 32 x 256) is level with cuBLAS tensorwise at o (8.06 vs 8.02 us) and behind
# it at down (18.7 vs 16.9 us; both before the scale epilogue, which inductor fuses into the next kernel);
# inside the native engine's decode step, though, it launches with PDL and the step ran 1.3% faster with o and
# down on it too (``bench_fp8_rollout.py`` ``+cublasod`` A/B, one process; decision 0023), so they have entries.
TRITON_ROWWISE_MIN_M, TRITON_ROWWISE_MAX_M = 33, 64  # measured at M = 64 only (one 64-row tile)
TRITON_ROWWISE_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (6144, 4096): {"block_m": 64, "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 5},
    (24576, 4096): {"block_m": 64, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 4},
    (4096, 4096): {"block_m": 64, "block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 6},
    (4096, 12288): {"block_m": 64, "block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 6},
}

_FAILED: set[tuple] = set()


@dataclass(frozen=True, slots=True)
class ScaleLayout:
    """How one operand's dequant scale maps onto it: ``kind`` in tensor / row / block."""

    kind: str
    block_size: tuple[int, int] | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def infer_scale_layout(
    shape: torch.Size | tuple[int, int],
    scale: torch.Tensor,
    *,
    is_weight: bool,
    block_size: tuple[int, int] | None = None,
) -> ScaleLayout:
    """Infer the layout of ``scale`` for a 2-D operand of ``shape`` (rows, K)."""
    rows, k = shape
    if block_size is not None:
        return ScaleLayout(kind="block", block_size=(int(block_size[0]), int(block_size[1])))
    if scale.numel() == 1:
        return ScaleLayout(kind="tensor")
    if scale.dim() == 2 and tuple(scale.shape) == (rows, 1):
        return ScaleLayout(kind="row")
    if scale.dim() == 2 and tuple(scale.shape) == (rows, _cdiv(k, 128)):
        return ScaleLayout(kind="block", block_size=(1, 128))
    if is_weight and scale.dim() == 2 and tuple(scale.shape) == (_cdiv(rows, 128), _cdiv(k, 128)):
        return ScaleLayout(kind="block", block_size=(128, 128))
    raise ValueError(
        f"cannot infer the scale layout of scale shape {tuple(scale.shape)} for operand shape {tuple(shape)}; "
        f"allowed: () tensorwise, ({rows}, 1) rowwise, ({rows}, {_cdiv(k, 128)}) 1x128 blocks"
        + (f", ({_cdiv(rows, 128)}, {_cdiv(k, 128)}) 128x128 blocks" if is_weight else "")
        + "; or pass the block size explicitly"
    )


def _mode(la: ScaleLayout, lb: ScaleLayout) -> str | None:
    if la.kind == lb.kind == "tensor":
        return "tensorwise"
    if {la.kind, lb.kind} <= {"row", "tensor"}:  # row x row, or a scalar broadcast next to a row scale
        return "rowwise"
    if la.block_size == (1, 128) and lb.block_size == (128, 128):
        return "blockwise"
    return None


def _device_supports(mode: str, device: torch.device, k: int, out_dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":  # CPU tensorwise exists but is ~1000x slower than the emulation
        return False
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if getattr(torch.version, "hip", None) is not None:
        return mode in ("tensorwise", "rowwise") and (mode != "rowwise" or out_dtype == torch.bfloat16)
    cap = torch.cuda.get_device_capability(device)
    if mode == "blockwise":
        return cap[0] == 9 and k % 128 == 0 and out_dtype == torch.bfloat16
    if mode == "rowwise":
        return cap >= (8, 9) and out_dtype == torch.bfloat16
    return cap >= (8, 9)


def _layouts(a_q, a_scale, b_q, b_scale, a_block_size, b_block_size) -> tuple[ScaleLayout, ScaleLayout]:
    la = infer_scale_layout(a_q.shape, a_scale, is_weight=False, block_size=a_block_size)
    lb = infer_scale_layout(b_q.shape, b_scale, is_weight=True, block_size=b_block_size)
    return la, lb


def _check_operands(a_q: torch.Tensor, b_q: torch.Tensor) -> None:
    if a_q.dim() != 2 or b_q.dim() != 2:
        raise ValueError(f"a_q must be (M, K) and b_q (N, K); got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"K mismatch: a_q {tuple(a_q.shape)} vs b_q {tuple(b_q.shape)} (b is the (N, K) weight)")


def gemm_path(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    a_block_size: tuple[int, int] | None = None,
    b_block_size: tuple[int, int] | None = None,
) -> GemmPath:
    """Name of the path :func:`scaled_mm` would take for these operands."""
    _check_operands(a_q, b_q)
    la, lb = _layouts(a_q, a_scale, b_q, b_scale, a_block_size, b_block_size)
    mode = _mode(la, lb)
    if mode is None:
        return "emulated"
    k, n = a_q.shape[1], b_q.shape[0]
    both_e5m2 = fp8_format(a_q.dtype).name.startswith("e5m2") and fp8_format(b_q.dtype).name.startswith("e5m2")
    if k % 16 or n % 16 or both_e5m2:
        return "emulated"
    m = a_q.shape[0]
    key = _failure_key(a_q, b_q, mode, out_dtype)
    cublas_ok = key not in _FAILED and _device_supports(mode, a_q.device, k, out_dtype)
    if mode == "blockwise" and (m < CUBLAS_BLOCKWISE_MIN_M or not _cublas_blockwise_layout_ok(n, k)):
        cublas_ok = False
    prefer_triton = not cublas_ok or (m <= TRITON_BLOCKWISE_MAX_M and k <= TRITON_BLOCKWISE_MAX_K)
    if mode == "blockwise" and prefer_triton and _triton_blockwise_ok(a_q, b_q, k):
        return "triton_blockwise"
    if mode == "rowwise" and TRITON_ROWWISE_MIN_M <= m <= TRITON_ROWWISE_MAX_M and _triton_rowwise_ok(a_q, b_q, out_dtype):
        return "triton_rowwise"
    if mode == "rowwise" and m <= ROWWISE_EPILOGUE_MAX_M and _epilogue_ok(a_q, b_q, out_dtype):
        return "scaled_mm_rowwise_epilogue"
    return f"scaled_mm_{mode}" if cublas_ok else "emulated"


def _cublas_blockwise_layout_ok(n: int, k: int) -> bool:
    """cuBLAS blockwise (torch 2.11, CUDA 13.0, H200) is silently wrong (-16 to -66 dB) when the weight
    has more than one 128-row block and K / 128 is not a multiple of 4 (K = 128..768 except 512,
    found on an H200); a padded scale stride is
    refused by torch. Those shapes take the Triton kernel or the emulation instead."""
    return -(-n // 128) == 1 or (-(-k // 128)) % 4 == 0


def _failure_key(a_q: torch.Tensor, b_q: torch.Tensor, mode: str, out_dtype: torch.dtype) -> tuple:
    m = a_q.shape[0]
    m_class = m if m < 16 else "large"  # a failure at one decode M must not disable every M
    return (a_q.device.type, mode, a_q.dtype, b_q.dtype, out_dtype, m_class)


def _epilogue_ok(a_q: torch.Tensor, b_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    key = _failure_key(a_q, b_q, "rowwise_epilogue", out_dtype)
    return key not in _FAILED and _device_supports("tensorwise", a_q.device, a_q.shape[1], torch.float32)


def _triton_rowwise_ok(a_q: torch.Tensor, b_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    n, k = b_q.shape
    config = TRITON_ROWWISE_CONFIGS.get((n, k))
    if config is None or _failure_key(a_q, b_q, "triton_rowwise", out_dtype) in _FAILED:
        return False
    from lumenrl_quant import triton_gemm as tg

    return _triton_blockwise_ok(a_q, b_q, k) and tg.supports(k, config)


def _triton_blockwise_ok(a_q: torch.Tensor, b_q: torch.Tensor, k: int) -> bool:
    if a_q.device.type != "cuda" or k % 128 or getattr(torch.version, "hip", None) is not None:
        return False
    from lumenrl_quant import triton_kernels as tk

    return tk.triton_available(a_q.device) and torch.cuda.get_device_capability(a_q.device) >= (8, 9)


def emulated_scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    a_block_size: tuple[int, int] | None = None,
    b_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Exact reference: dequantize both operands, matmul in float32, add bias, cast."""
    _check_operands(a_q, b_q)
    la, lb = _layouts(a_q, a_scale, b_q, b_scale, a_block_size, b_block_size)
    a = dequantize_fp8(a_q, a_scale, block_size=la.block_size)
    b = dequantize_fp8(b_q, b_scale, block_size=lb.block_size)
    out = a @ b.t()
    if bias is not None:
        out = out + bias.float()
    return as_dtype(out, out_dtype)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, but no op at all (not even an identity ``to`` node) when ``t`` already is ``dtype``.

    Inside an ``autograd.Function`` traced by dynamo, an identity ``to`` makes a second graph value
    for the same tensor; torch 2.11 returns such aliases of the output as extra subgraph outputs,
    which re-routes the output's gradient and zeroes every input gradient (pytorch#180642).
    """
    return t if t.dtype == dtype else t.to(dtype)


def _torch_scaled_mm(mode: str, a_q, a_scale, b_q, b_scale, out_dtype) -> torch.Tensor:
    sa, sb = a_scale.float(), b_scale.float()
    if mode == "tensorwise":
        sa, sb = sa.reshape(()), sb.reshape(())
    elif mode == "rowwise":  # (M, 1), (1, N); a () scale next to a row scale is broadcast
        sa = sa.reshape(-1, 1).expand(a_q.shape[0], 1).contiguous()
        sb = sb.reshape(1, -1).expand(1, b_q.shape[0]).contiguous()
    else:  # blockwise: 1x128 scales outer-dim-major, 128x128 weight scales transposed view
        sa, sb = sa.t().contiguous().t(), sb.contiguous().t()
    return torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _unit_scale(device: torch.device) -> torch.Tensor:
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


_EPILOGUE_KERNEL: list = []  # the Triton epilogue kernel, defined on first use (triton is imported lazily)


def _epilogue_kernel():
    """The ``acc * sa * sb (+ bias) -> out`` Triton kernel, or None without triton."""
    if _EPILOGUE_KERNEL:
        return _EPILOGUE_KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - exercised where triton is absent
        _EPILOGUE_KERNEL.append(None)
        return None

    @triton.jit
    def row_epilogue_kernel(acc_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, stride_acc, stride_out,
                            stride_sa, stride_sb, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mm, nm = offs_m < M, offs_n < N
        mask = mm[:, None] & nm[None, :]
        acc = tl.load(acc_ptr + offs_m[:, None] * stride_acc + offs_n[None, :], mask=mask, other=0.0)
        sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mm, other=0.0)
        sb = tl.load(sb_ptr + offs_n * stride_sb, mask=nm, other=0.0)
        out = (acc * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)

    _EPILOGUE_KERNEL.append(row_epilogue_kernel)
    return row_epilogue_kernel


def triton_rowwise_epilogue(
    acc: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`rowwise_epilogue` as one Triton kernel (float32 ``acc`` (M, N), scales (M|1) and (N|1))."""
    kernel = _epilogue_kernel()
    if kernel is None:
        raise RuntimeError("triton is not installed: pip install lumenrl-quant[triton]")
    m, n = acc.shape
    acc = acc if acc.stride(1) == 1 else acc.contiguous()
    sa, sb = a_scale.float().reshape(-1), b_scale.float().reshape(-1)
    if sa.numel() not in (1, m) or sb.numel() not in (1, n):
        raise ValueError(f"scales of {sa.numel()} and {sb.numel()} elements do not fit acc {tuple(acc.shape)}; "
                         f"allowed: 1 or {m} for a_scale, 1 or {n} for b_scale")
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    block_m, block_n = min(16, 1 << max(0, (m - 1).bit_length())), 256
    kernel[(_cdiv(m, block_m), _cdiv(n, block_n))](
        acc, sa, sb, bias if bias is not None else sa, out, m, n, acc.stride(0), out.stride(0),
        0 if sa.numel() == 1 else sa.stride(0), 0 if sb.numel() == 1 else sb.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return out


def rowwise_epilogue(
    acc: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(acc * a_scale[:, None] * b_scale[None, :] + bias).to(out_dtype)`` for a float32 ``acc`` (M, N).

    Plain torch ops (inductor fuses them into one kernel, usually with the following op); eager
    it runs as one Triton kernel on CUDA (:func:`triton_rowwise_epilogue`), else as two torch
    kernels, the second writing ``out_dtype`` directly.
    """
    if torch.compiler.is_compiling() or acc.requires_grad:
        sa, sb = a_scale.float().reshape(-1, 1), b_scale.float().reshape(1, -1)
        out = acc * sa * sb
        return as_dtype(out if bias is None else out + bias.float(), out_dtype)
    if acc.is_cuda and _epilogue_kernel() is not None and (bias is None or bias.is_contiguous()):
        return triton_rowwise_epilogue(acc, a_scale, b_scale, bias, out_dtype)
    sa, sb = a_scale.float().reshape(-1, 1), b_scale.float().reshape(1, -1)
    acc = acc.mul_(sa)
    if bias is not None:
        acc = torch.addcmul(bias.float(), acc, sb, out=acc)
        return acc.to(out_dtype)
    return torch.mul(acc, sb, out=torch.empty(acc.shape, dtype=out_dtype, device=acc.device))


def run_gemm_path(
    path: GemmPath,
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    a_block_size: tuple[int, int] | None = None,
    b_block_size: tuple[int, int] | None = None,
    unit_scale: torch.Tensor | None = None,
    pdl: bool = False,
    pdl_prefetch: int = 512,
    tma: bool = False,
) -> torch.Tensor:
    """Run ``path`` (from :func:`gemm_path`) as is: no checks, no fallback, traceable by dynamo.

    ``unit_scale``: a float32 ``()`` one on the operands' device for ``scaled_mm_rowwise_epilogue``
    (a cached one is used when None; pass a module-held one inside ``torch.compile``).
    ``pdl``: the ``triton_rowwise`` path launches with programmatic dependent launch where supported
    (:func:`lumenrl_quant.triton_gemm.fp8_rowwise_gemm`), prefetching ``pdl_prefetch`` bytes of each weight
    row; ``tma``: its tiles are copied by the tensor memory accelerator (launch option ``tma``, sm90+); the other
    paths ignore these three.
    """
    if path == "triton_blockwise":
        from lumenrl_quant import triton_kernels as tk

        out = tk.fp8_blockwise_gemm(a_q, a_scale, b_q, b_scale, out_dtype=out_dtype)
        return out if bias is None else (out + bias.to(out_dtype))
    if path == "triton_rowwise":
        from lumenrl_quant import triton_gemm as tg

        config = TRITON_ROWWISE_CONFIGS[tuple(b_q.shape)]
        config = {**config, "tma": 1} if tma else config
        return tg.fp8_rowwise_gemm(a_q, a_scale, b_q, b_scale, out_dtype=out_dtype, bias=bias, config=config, pdl=pdl,
                                   prefetch=pdl_prefetch)
    if path == "scaled_mm_rowwise_epilogue":
        one = unit_scale if unit_scale is not None else _unit_scale(a_q.device)
        acc = torch._scaled_mm(a_q.contiguous(), b_q.contiguous().t(), scale_a=one, scale_b=one,
                               out_dtype=torch.float32)
        return rowwise_epilogue(acc, a_scale, b_scale, bias, out_dtype)
    if path.startswith("scaled_mm_"):
        mode = path.removeprefix("scaled_mm_")
        out = _torch_scaled_mm(mode, a_q.contiguous(), a_scale, b_q.contiguous(), b_scale, out_dtype)
        return out if bias is None else (out + bias.to(out_dtype))
    if path != "emulated":
        raise ValueError(f"path={path!r} is not a GEMM path; allowed: scaled_mm_<mode>, triton_blockwise, triton_rowwise, emulated")
    return emulated_scaled_mm(
        a_q, a_scale, b_q, b_scale, out_dtype=out_dtype, bias=bias, a_block_size=a_block_size,
        b_block_size=b_block_size,
    )


def scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    a_block_size: tuple[int, int] | None = None,
    b_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale).T (+ bias)`` as ``out_dtype``, on the fastest correct path."""
    path = gemm_path(
        a_q, a_scale, b_q, b_scale, out_dtype=out_dtype, a_block_size=a_block_size, b_block_size=b_block_size
    )
    kw = {"out_dtype": out_dtype, "bias": bias, "a_block_size": a_block_size, "b_block_size": b_block_size}
    for _ in range(3):  # a failing path is remembered, and gemm_path then names the next best one
        if not path.startswith("scaled_mm_"):
            break
        try:
            return run_gemm_path(path, a_q, a_scale, b_q, b_scale, **kw)
        except (RuntimeError, NotImplementedError) as err:
            note_gemm_failure(path, a_q, b_q, out_dtype, err)
            path = gemm_path(a_q, a_scale, b_q, b_scale, out_dtype=out_dtype, a_block_size=a_block_size,
                             b_block_size=b_block_size)
    if path.startswith("scaled_mm_"):
        path = "emulated"
    return run_gemm_path(path, a_q, a_scale, b_q, b_scale, **kw)


def note_gemm_failure(path: GemmPath, a_q: torch.Tensor, b_q: torch.Tensor, out_dtype: torch.dtype,
                      err: BaseException) -> None:
    """Remember that ``path`` raised for this operand class (re-raise inside CUDA-graph capture), warn once."""
    if a_q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise err  # never bake a silent fallback into a CUDA graph
    mode = path.removeprefix("scaled_mm_")
    _FAILED.add(_failure_key(a_q, b_q, mode, out_dtype))
    warnings.warn(f"torch._scaled_mm {mode} failed here ({err}); falling back to the next path "
                  "(finally the emulation)", stacklevel=3)
