"""Rowwise-scaled FP8 GEMM for decode-sized M in Triton, with split-K.

``out[m, n] = sa[m] * sb[n] * sum_k a_q[m, k] * b_q[n, k]`` (W8A8 with per-token activation
scales ``sa`` (M, 1) and per-channel weight scales ``sb`` (N, 1), the ``fp8_row`` scheme).

Why: at decode, M (the batch) is 1..256 while N and K are the model's widths. A GEMM there reads
the weight once and is bandwidth-bound; what matters is how many programs stream the weight at
once. cuBLAS' FP8 kernels at M = 64 and N = 4096 (the 8B attention projections) run 48x64 tiles
at ~1.6 TB/s on the H200 (engine profile, RESULTS.md), well under the ~3.4 TB/s its bf16 GEMMs reach
on the MLP. This kernel tiles N by ``block_n`` and splits K into ``split_k`` slices, so that
``N / block_n * split_k`` programs cover the multiprocessors several times:

* ``split_k == 1``: one program per N tile walks all of K and applies the scales (and the output
  cast) in its epilogue: one kernel, output in ``out_dtype``;
* ``split_k > 1``: each program writes a float32 partial (split, M, N); the partials are summed and
  scaled by :func:`lumenrl_quant.gemm.rowwise_epilogue` in plain torch ops, which
  ``torch.compile`` fuses into one kernel with the op that follows.

Also here, for the fused SwiGLU MLP (:mod:`lumenrl_quant.fused_mlp`): :func:`fp8_swiglu_quant` (the
gate/up GEMM with SiLU * up and a 1 x ``group`` FP8 quantization in its epilogue) and
:func:`fp8_group_act_gemm` (this kernel with per-(token, group) activation scales applied per K block).

Accumulation is float32 (``tl.dot`` of FP8 operands), so the result equals the float32 emulation
up to summation order. K must be a multiple of ``split_k * block_k`` (checked; the caller falls
back to cuBLAS otherwise). Launch parameters come from ``config`` (``block_m``, ``block_n``,
``block_k``, ``split_k``, ``num_warps``, ``num_stages``, and ``tma``: 1 copies the tiles with the tensor memory
accelerator through host tensor descriptors instead of pointer loads, where :func:`tma_reason` allows; the same
tiles in the same order, so the same bits); ``benchmarks/quant/bench_decode_gemm.py`` sweeps them against cuBLAS at
the engine's shapes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = [
    "DEFAULT_CONFIG", "SWIGLU_DEFAULT_CONFIG", "fp8_group_act_gemm", "fp8_rowwise_gemm", "fp8_swiglu_quant",
    "fp8_weight_only_gemm", "pdl_supported", "supports", "tma_reason",
]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - no Triton, or one without host tensor descriptors
    TensorDescriptor = None

DEFAULT_CONFIG: dict[str, int] = {"block_m": 64, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4,
                                  "num_stages": 4, "tma": 0}


def supports(k: int, config: Mapping[str, int] | None = None) -> bool:
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return triton is not None and k % (cfg["split_k"] * cfg["block_k"]) == 0


if triton is not None:

    @triton.jit
    def _rowwise_gemm_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N,
        stride_am, stride_bn, stride_cs, stride_cm,
        K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EPILOGUE: tl.constexpr, WEIGHT_ONLY: tl.constexpr = False, DOT_FP16: tl.constexpr = False,
        A_GROUP: tl.constexpr = 0, stride_sam=0, stride_sag=0, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
        a_desc=None, b_desc=None, TMA: tl.constexpr = False,
    ):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask, nmask = offs_m < M, offs_n < N
        k0 = pid_k * K_SPLIT
        if PREFETCH > 0:  # PDL: the weight does not depend on the previous kernel, start streaming it to L2
            lines = tl.arange(0, PREFETCH // 128) * 128  # one prefetch per 128-byte line (one FP8 byte each)
            rows = tl.minimum(offs_n, N - 1).to(tl.int64)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [b_ptr + rows[:, None] * stride_bn + (k0 + lines)[None, :]], dtype=tl.int32,
                                      is_pure=False, pack=1)
        if PDL:  # wait for the previous kernel (its writes: a, sa), then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :]
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + (k0 + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if A_GROUP > 0:  # group scales stored group-major (stride_sam 1): one contiguous load per K block
            sa_next = tl.load(sa_ptr + (k0 // A_GROUP) * stride_sag + offs_m * stride_sam, mask=mmask, other=0.0)
        for kk in range(0, K_SPLIT, BLOCK_K):
            if TMA:  # tensor-memory-accelerator tile copies (rows past M or N read as zeros)
                a = a_desc.load([pid_m * BLOCK_M, k0 + kk])
                b = b_desc.load([pid_n * BLOCK_N, k0 + kk])
            else:
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=nmask[:, None], other=0.0)
            if WEIGHT_ONLY:  # 16-bit activations, FP8 weight widened in registers (E4M3 -> fp16: one cvt)
                if DOT_FP16:
                    a = a.to(tl.float16)
                    b = b.to(tl.float16)
                else:
                    b = b.to(tl.float32).to(a.dtype)  # explicit: the interpreter miscasts E4M3 -> bf16
            if A_GROUP > 0:  # 1 x A_GROUP activation scales (M, K / A_GROUP): applied per K block
                sa_k = sa_next  # loaded one iteration ahead: its latency hides behind this block's MMA
                ahead = kk + BLOCK_K < K_SPLIT
                sa_next = tl.load(sa_ptr + ((k0 + kk + BLOCK_K) // A_GROUP) * stride_sag + offs_m * stride_sam,
                                  mask=mmask & ahead, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * sa_k[:, None]
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
        if EPILOGUE:
            sb = tl.load(sb_ptr + offs_n, mask=nmask, other=0.0)
            out = acc * sb[None, :]
            if not WEIGHT_ONLY and A_GROUP == 0:  # stride_sam 0: one scale for every row (a per-tensor scale)
                sa = tl.load(sa_ptr + offs_m * stride_sam, mask=mmask, other=0.0)
                out = out * sa[:, None]
            tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
        else:
            tl.store(c_ptrs, acc, mask=mmask[:, None] & nmask[None, :])


_POWER_OF_TWO_MIN = {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 1, "num_warps": 1, "group": 16}


def _checked(config: Mapping[str, int] | None, defaults: Mapping[str, int]) -> dict[str, int]:
    """``defaults`` overridden by ``config``; unknown keys and bad values raise, naming them."""
    cfg = {**defaults, **(config or {})}
    unknown = set(cfg) - set(defaults)
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)}; allowed: {sorted(defaults)}")
    for name, value in cfg.items():
        low = _POWER_OF_TWO_MIN.get(name)
        if low is not None and (not isinstance(value, int) or value < low or value & (value - 1)):
            raise ValueError(f"config {name}={value!r}; allowed: a power of two >= {low}")
    if not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1:
        raise ValueError(f"config num_stages={cfg['num_stages']!r}; allowed: an int >= 1")
    if cfg.get("tma", 0) not in (0, 1) or isinstance(cfg.get("tma"), bool):
        raise ValueError(f"config tma={cfg['tma']!r}; allowed: 0 (pointer loads) or 1 (TMA tile copies)")
    return cfg


def _config(config: Mapping[str, int] | None) -> dict[str, int]:
    return _checked(config, DEFAULT_CONFIG)


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton does at import
PDL_PREFETCH = 512  # bytes of each weight row a PDL launch prefetches to L2 before it waits (see fp8_rowwise_gemm)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA compute capability 9.0+ with Triton (not its interpreter, not ROCm)."""
    return (triton is not None and not _INTERPRETED and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _launch_checks(a: torch.Tensor, b_q: torch.Tensor, cfg: Mapping[str, int], a_group: int = 0) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed: pip install lumenrl-quant[triton]")
    k = a.shape[1]
    if b_q.shape[1] != k:
        raise ValueError(f"need a (M, K), b (N, K); got {tuple(a.shape)}, {tuple(b_q.shape)}")
    split, block_k = cfg["split_k"], cfg["block_k"]
    if k % (split * block_k):
        raise ValueError(f"K={k} must be a multiple of split_k * block_k = {split} * {block_k}")
    if a_group and (a_group % block_k or (k // split) % a_group):
        raise ValueError(f"group={a_group} must be a multiple of block_k={block_k} and divide K / split_k = {k // split}")


def _launch(
    a: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
    config: Mapping[str, int] | None, *, weight_only: bool = False, dot_fp16: bool = False, a_group: int = 0,
    pdl: bool = False, prefetch: int = PDL_PREFETCH,
) -> torch.Tensor:
    """Checks and one launch of the kernel: ``out_dtype`` (M, N) with the scales applied when
    ``split_k`` is 1, else the float32 partial sums (split_k, M, N) for the caller's epilogue.
    ``pdl`` (callers check :func:`pdl_supported`): launched with programmatic dependent launch, each program
    prefetching the first ``prefetch`` bytes of its weight rows to L2 before it waits for the previous kernel."""
    cfg = _config(config)
    _launch_checks(a, b_q, cfg, a_group)
    (m, k), n = a.shape, b_q.shape[0]
    split, block_k = cfg["split_k"], cfg["block_k"]
    a, b_q = a.contiguous(), b_q.contiguous()
    epilogue = split == 1
    c = torch.empty((m, n) if epilogue else (split, m, n), dtype=out_dtype if epilogue else torch.float32,
                    device=a.device)
    grid = (triton.cdiv(n, cfg["block_n"]), split, triton.cdiv(m, cfg["block_m"]))
    prefetch = min(prefetch, k // split) if pdl and b_q.element_size() == 1 else 0  # bytes (= FP8 columns) per row
    prefetch = 1 << (prefetch.bit_length() - 1) if prefetch >= 128 else 0  # a power of two within the row
    descs = {"a_desc": a, "b_desc": b_q, "TMA": False}  # unused without TMA; passed so every launch names them all
    if cfg["tma"] and torch.compiler.is_compiling():
        raise ValueError(f"config tma=1 with split_k={split} under torch.compile: TMA launches run in the opaque "
                         "op lumenrl_quant::fp8_rowwise_gemm_pdl, which takes split_k 1")
    if cfg["tma"] and tma_reason(a, b_q) is None:
        descs = {"a_desc": TensorDescriptor.from_tensor(a, [cfg["block_m"], block_k]),
                 "b_desc": TensorDescriptor.from_tensor(b_q, [cfg["block_n"], block_k]), "TMA": True}
    _rowwise_gemm_kernel[grid](
        a, b_q, c, sa, sb, m, n, a.stride(0), b_q.stride(0), 0 if epilogue else c.stride(0), c.stride(-2),
        K_SPLIT=k // split, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k, EPILOGUE=epilogue,
        WEIGHT_ONLY=weight_only, DOT_FP16=dot_fp16, A_GROUP=a_group,
        stride_sam=sa.stride(0) if a_group else int(sa.numel() > 1),  # one activation scale: read for every row
        stride_sag=sa.stride(1) if a_group else 0, PDL=bool(pdl), PREFETCH=prefetch, **descs,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if pdl else {}),
    )
    return c


def tma_reason(*tensors: torch.Tensor) -> str | None:
    """None when the tensor memory accelerator can copy tiles of these 2-D operands (``config["tma"] = 1``: CUDA
    sm90+ or Triton's interpreter, 16-byte aligned base and row stride, unit last stride), else why not; where it
    cannot, the kernel loads the tiles with pointers (the same sums)."""
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors (triton.tools.tensor_descriptor)"
    for t in tensors:
        if t.device.type == "cuda" and torch.cuda.get_device_capability(t.device) < (9, 0):
            return f"device capability {torch.cuda.get_device_capability(t.device)}; TMA needs (9, 0) or newer"
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return (f"operand {tuple(t.shape)} stride {tuple(t.stride())} at {t.data_ptr() % 16} bytes past 16: "
                    "TMA needs a 16-byte aligned base and row stride, unit last stride")
    return None


def _pdl_op_impl(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
                 block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                 prefetch: int = PDL_PREFETCH, tma: int = 0, pdl: bool = True) -> torch.Tensor:
    config = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "split_k": 1, "num_warps": num_warps,
              "num_stages": num_stages, "tma": tma}
    return _launch(a_q, b_q, sa, sb, out_dtype, config, pdl=pdl and pdl_supported(a_q.device),  # decided here
                   prefetch=prefetch)


def _pdl_op_fake(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
                 block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                 prefetch: int = PDL_PREFETCH, tma: int = 0, pdl: bool = True) -> torch.Tensor:
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


def _register_pdl_op():  # noqa: ANN202 - a torch.library CustomOpDef
    """``lumenrl_quant::fp8_rowwise_gemm_pdl``: the PDL and TMA launches as an op opaque to ``torch.compile``
    (dynamo's tracing of user Triton kernels takes no ``launch_pdl`` and no host tensor descriptors); registered at
    import, once per process."""
    if triton is None:
        return None
    op = getattr(torch.ops.lumenrl_quant, "fp8_rowwise_gemm_pdl", None)
    if op is None:
        op = torch.library.custom_op("lumenrl_quant::fp8_rowwise_gemm_pdl", mutates_args=())(_pdl_op_impl)
        op.register_fake(_pdl_op_fake)
    return op


_PDL_OP = _register_pdl_op()


def fp8_rowwise_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
    pdl: bool = False,
    prefetch: int = PDL_PREFETCH,
) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale).T (+ bias)`` for FP8 ``a_q`` (M, K), ``b_q`` (N, K), float32
    ``a_scale`` (M, 1) or (M,) (or one scale: one element, or a broadcast view of one, which is read as it is),
    ``b_scale`` (N, 1) or (N,); ``config`` overrides the launch parameters.

    ``pdl``: where supported (:func:`pdl_supported`; CUDA sm90+) and with ``split_k`` 1, the kernel launches
    with programmatic dependent launch: it may start while the previous kernel in the stream finishes,
    prefetches the first ``prefetch`` bytes of its weight rows to L2 (a power of two >= 128 within the row;
    0: none), waits for that kernel (``griddepcontrol.wait``: it reads ``a_q`` and
    ``a_scale`` only after it), then lets the next PDL kernel launch. Same result as without; runs as the
    op ``lumenrl_quant::fp8_rowwise_gemm_pdl`` (opaque to ``torch.compile``), which decides at run time;
    elsewhere the same kernel launches plainly. A ``config`` with ``"tma": 1`` and ``split_k`` 1 runs in that op
    too (under ``torch.compile`` a TMA launch with ``split_k`` > 1 is refused)."""
    from lumenrl_quant.gemm import rowwise_epilogue

    sa, sb = a_scale.float().reshape(-1), b_scale.float().reshape(-1).contiguous()
    if sa.numel() > 1 and sa.stride(0) == 0:  # one scale broadcast over the rows: the kernel reads it per row
        sa = sa[:1]
    sa = sa.contiguous()  # (M,) or (1,): no copy of a broadcast scale (it cost a kernel per call under compile)
    cfg = _config(config)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}; allowed: an int >= 0 (bytes of each weight row)")
    if (pdl or cfg["tma"]) and cfg["split_k"] == 1 and _PDL_OP is not None:  # the launch options run in the op
        _launch_checks(a_q, b_q, cfg)
        # eager and under CUDA graph capture, the implementation itself (torch.library's dispatch costs more host
        # time than the launch); the registered op where torch.compile traces
        op = _PDL_OP if torch.compiler.is_compiling() else _pdl_op_impl
        c = op(a_q.contiguous(), b_q.contiguous(), sa, sb, out_dtype, cfg["block_m"], cfg["block_n"],
               cfg["block_k"], cfg["num_warps"], cfg["num_stages"], prefetch, cfg["tma"], bool(pdl))
        return c if bias is None else c + bias.to(out_dtype)
    c = _launch(a_q, b_q, sa, sb, out_dtype, config)
    if c.dim() == 2:
        return c if bias is None else c + bias.to(out_dtype)
    return rowwise_epilogue(c.sum(0), sa, sb, bias, out_dtype)


def fp8_weight_only_gemm(
    x: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    dot_dtype: torch.dtype = torch.bfloat16,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """W8A16: ``x @ (b_q * b_scale).T (+ bias)`` for 16-bit ``x`` (M, K) and an FP8 weight ``b_q`` (N, K)
    with per-channel ``b_scale`` (N, 1) or (N,). The weight tile is widened to ``dot_dtype`` in registers
    (``torch.bfloat16``, or ``torch.float16``: E4M3 -> fp16 is one conversion, but x must fit fp16's
    range), so no activation is quantized. An experiment for decode (``bench_decode_gemm.py``): the
    same weight bytes as W8A8 without the per-linear activation quantization or its rounding."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x dtype={x.dtype}; allowed: torch.bfloat16, torch.float16")
    if dot_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dot_dtype={dot_dtype}; allowed: torch.bfloat16, torch.float16")
    out_dtype = out_dtype or x.dtype
    sb = b_scale.float().reshape(-1).contiguous()
    c = _launch(x, b_q, sb, sb, out_dtype, config, weight_only=True, dot_fp16=dot_dtype == torch.float16)
    if c.dim() == 3:
        c = (c.sum(0) * sb[None, :]).to(out_dtype)
    return c if bias is None else c + bias.to(out_dtype)


def fp8_group_act_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    group: int,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale).T (+ bias)`` with activations scaled per token group:
    ``a_scale`` (M, K / group) (the 1 x ``group`` blocks :func:`fp8_swiglu_quant` writes), ``b_scale``
    per output channel (N, 1) or (N,). ``group`` must be a multiple of ``config['block_k']``. Fastest with
    ``a_scale`` stored group-major (``a_scale.stride(0) == 1``, as :func:`fp8_swiglu_quant` returns it):
    each K block then loads its BLOCK_M scales contiguously."""
    m, k = a_q.shape
    if group < 1 or k % group or tuple(a_scale.shape) != (m, k // group):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} with group={group}; need ({m}, {k} / group) "
                         f"and K={k} divisible by group")
    sa, sb = a_scale.float(), b_scale.float().reshape(-1).contiguous()
    c = _launch(a_q, b_q, sa, sb, out_dtype, config, a_group=group)
    if c.dim() == 3:
        c = (c.sum(0) * sb[None, :]).to(out_dtype)
    return c if bias is None else c + bias.to(out_dtype)


SWIGLU_DEFAULT_CONFIG: dict[str, int] = {"group": 128, "block_m": 64, "block_k": 128, "num_warps": 8, "num_stages": 4}

if triton is not None:

    @triton.jit
    def _swiglu_quant_kernel(
        a_ptr, w_ptr, sa_ptr, sw_ptr, q_ptr, qs_ptr, M, INTER,
        stride_am, stride_wn, stride_qm, stride_qsg,
        K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        # one program: GROUP features of gate (rows f of w) and of up (rows INTER + f) for BLOCK_M tokens
        pid_f, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_f = pid_f * GROUP + tl.arange(0, GROUP)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        g_ptrs = w_ptr + offs_f.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        u_ptrs = w_ptr + (offs_f + INTER).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            acc_g = tl.dot(a, tl.trans(tl.load(g_ptrs)), acc_g)
            acc_u = tl.dot(a, tl.trans(tl.load(u_ptrs)), acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        sa = tl.load(sa_ptr + offs_m, mask=mmask, other=0.0)[:, None]
        gate = acc_g * sa * tl.load(sw_ptr + offs_f)[None, :]
        up = acc_u * sa * tl.load(sw_ptr + INTER + offs_f)[None, :]
        h = gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up, float32
        amax = tl.max(tl.abs(h), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_f[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=mmask[:, None])
        tl.store(qs_ptr + pid_f * stride_qsg + offs_m, scale, mask=mmask)


def _swiglu_config(config: Mapping[str, int] | None) -> dict[str, int]:
    return _checked(config, SWIGLU_DEFAULT_CONFIG)


def fp8_swiglu_quant(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up GEMM of a SwiGLU MLP with SiLU * up and the FP8 quantization of the result in its
    epilogue: ``h = silu(a @ w[:I].T) * (a @ w[I:].T)`` for FP8 ``a_q`` (M, K) with per-token
    ``a_scale`` (M, 1) and the fused gate/up weight ``w_q`` (2I, K) = cat([gate, up]) with per-channel
    ``w_scale`` (2I, 1); returns ``h`` quantized to ``out_dtype`` in 1 x ``group`` blocks: codes (M, I)
    and dequant scales (M, I / group) (``amax / fp8_max``, 1 for an all-zero block; stored group-major,
    i.e. the transpose of a contiguous (I / group, M), for :func:`fp8_group_act_gemm`). Each program owns
    ``group`` features of both halves, so the quantization needs no reduction across programs."""
    if triton is None:
        raise RuntimeError("triton is not installed: pip install lumenrl-quant[triton]")
    from lumenrl_quant.formats import fp8_max

    cfg = _swiglu_config(config)
    (m, k), (n2, kw) = a_q.shape, w_q.shape
    group, block_k = cfg["group"], cfg["block_k"]
    if kw != k or n2 % 2:
        raise ValueError(f"need a (M, K) and w (2I, K); got {tuple(a_q.shape)}, {tuple(w_q.shape)}")
    inter = n2 // 2
    if inter % group or k % block_k:
        raise ValueError(f"I={inter} must be a multiple of group={group} and K={k} of block_k={block_k}")
    a_q, w_q = a_q.contiguous(), w_q.contiguous()
    sa, sw = a_scale.float().reshape(-1).contiguous(), w_scale.float().reshape(-1).contiguous()
    if sa.numel() == 1 and m > 1:
        sa = sa.expand(m).contiguous()
    q = torch.empty((m, inter), dtype=out_dtype, device=a_q.device)
    qs = torch.empty((inter // group, m), dtype=torch.float32, device=a_q.device)  # group-major
    grid = (inter // group, triton.cdiv(m, cfg["block_m"]))
    _swiglu_quant_kernel[grid](
        a_q, w_q, sa, sw, q, qs, m, inter, a_q.stride(0), w_q.stride(0), q.stride(0), qs.stride(0),
        K=k, GROUP=group, BLOCK_M=cfg["block_m"], BLOCK_K=block_k, FP8_MAX=fp8_max(out_dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return q, qs.t()
