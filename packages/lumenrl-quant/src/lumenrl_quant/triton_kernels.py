"""Optional Triton kernels for FP8 quantization and a decode-shaped blockwise FP8 GEMM.

Design
------
Imported lazily and only when ``triton`` is installed (``pip install lumenrl-quant[triton]``);
nothing else in the package needs it, and every kernel has a plain-torch twin that is the
reference (:mod:`lumenrl_quant.fp8`, :mod:`lumenrl_quant.gemm`).

* ``fp8_quantize_groups(x, group)``: one pass per (row block, group) along the last dim; the
  group amax, the dequant scale ``amax / fp8_max`` (1 for all-zero groups) and the saturating
  cast all happen in registers. ``group=128`` gives 1x128 activation scales ``(M, K/128)``,
  ``group=K`` rowwise ``(M, 1)``. Division is IEEE round-to-nearest (``div_rn``) and the cast
  rounds to nearest even, so results are bit-identical to the torch path (checked on GPU by
  ``benchmarks/quant``); NaN inputs are not propagated into scales as torch does.
* ``fp8_quantize_blocks(w, 128)``: 128x128 weight blocks, scales ``(N/128, K/128)``.
* ``fp8_quantize_tensorwise(x)``: an amax pass (atomic max on the float bits, valid because
  magnitudes are non-negative) and a cast pass that derives the scale itself (no host round trip,
  CUDA-graph capturable).
* ``mx_quantize(x, elem_format)``: OCP MX (E4M3 / E5M2 / E2M1 packed) in one pass; the E8M0
  exponent is read off the amax's float exponent field, scaling is an exact power-of-two
  multiply, E2M1 rounding is integer rounding of the float32 bits to one mantissa bit (ties to
  even; 8 integer ops instead of 7 compares), bit-identical to :mod:`lumenrl_quant.mx`. MXFP4 of
  16-bit x reads int32 words (the two elements of one output byte) so no thread exchanges codes,
  and rounds in the float32 subnormal range so that all E2M1 codes come from one integer rounding.
* ``fp8_blockwise_gemm(a_q, a_scale, b_q, b_scale)``: ``out = (a*sa) @ (b*sb).T`` with 1x128
  activation and 128x128 weight scales, fp32 accumulation, one ``tl.dot`` per 128-wide K block
  scaled by ``sa[:, None] * sb[None, :]``; tiles sized for small (decode) M.

Shapes must divide exactly (K by the group / 128); callers fall back to torch otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from lumenrl_quant.formats import fp8_max

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = [
    "fp8_blockwise_gemm",
    "fp8_quantize_blocks",
    "fp8_quantize_groups",
    "fp8_quantize_tensorwise",
    "mx_quantize",
    "triton_available",
]


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when Triton is importable and ``device`` is a CUDA/ROCm GPU."""
    if triton is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def _tl_fp8(dtype: torch.dtype):
    table = {
        torch.float8_e4m3fn: tl.float8e4nv,
        torch.float8_e5m2: tl.float8e5,
        torch.float8_e4m3fnuz: tl.float8e4b8,
        torch.float8_e5m2fnuz: tl.float8e5b16,
    }
    if dtype not in table:
        raise ValueError(f"dtype={dtype} is not an FP8 dtype Triton can store; allowed: {list(table)}")
    return table[dtype]


if triton is not None:

    @triton.jit
    def _group_quant_kernel(
        x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
        FP8_MAX: tl.constexpr, OUT: tl.constexpr, REDUCE_ROWS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr,
    ):
        # A program owns BLOCK_M rows x NG groups. BLOCK_K >= GROUP: the whole tile stays in
        # registers (one read of x; NG > 1 needs BLOCK_K == GROUP, so columns are contiguous);
        # otherwise (NG == 1) two passes over the group (amax, then cast), the second mostly from L2.
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        row0 = pid_m.to(tl.int64) * BLOCK_M  # int64 row-block base (M * K may pass 2**31), int32 inside
        x_ptr += row0 * stride_xm
        q_ptr += row0 * stride_qm
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M - pid_m * BLOCK_M
        k0 = pid_g * NG * GROUP
        n_groups = K // GROUP
        gidx = pid_g * NG + tl.arange(0, NG)  # this program's group indices
        if BLOCK_K >= GROUP:
            cols = k0 + tl.arange(0, NG * BLOCK_K)
            if BLOCK_K == GROUP:
                cmask = cols < K
            else:  # NG == 1, group narrower than the power-of-two tile
                cmask = (cols < k0 + GROUP) & (cols < K)
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x3 = tl.reshape(x, (BLOCK_M, NG, BLOCK_K))
            amax = tl.max(tl.abs(x3), axis=2)  # (BLOCK_M, NG)
        else:
            amax = tl.zeros((BLOCK_M, NG), dtype=tl.float32)
            for kk in range(0, GROUP, BLOCK_K):
                cols = k0 + kk + tl.arange(0, BLOCK_K)
                mask = rmask[:, None] & (cols[None, :] < K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1)[:, None])
        if REDUCE_ROWS:  # one scale per BLOCK_M x GROUP tile
            amax_s = tl.max(amax, axis=0)  # (NG,)
            scale_s = tl.where(amax_s > 0, tl.math.div_rn(amax_s, FP8_MAX), 1.0)
            tl.store(s_ptr + pid_m * stride_sm + gidx, scale_s, mask=gidx < n_groups)
            scale = tl.zeros((BLOCK_M, NG), dtype=tl.float32) + scale_s[None, :]
        else:
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
            tl.store(s_ptr + row0 * stride_sm + rows[:, None] * stride_sm + gidx[None, :], scale,
                     mask=rmask[:, None] & (gidx[None, :] < n_groups))
        if BLOCK_K >= GROUP:
            q3 = tl.minimum(tl.maximum(tl.math.div_rn(x3, scale[:, :, None]), -FP8_MAX), FP8_MAX)
            q = tl.reshape(q3, (BLOCK_M, NG * BLOCK_K))
            tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(OUT), mask=mask)
        else:
            scale1 = tl.max(scale, axis=1)  # NG == 1
            for kk in range(0, GROUP, BLOCK_K):
                cols = k0 + kk + tl.arange(0, BLOCK_K)
                mask = rmask[:, None] & (cols[None, :] < K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale1[:, None]), -FP8_MAX), FP8_MAX)
                tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(OUT), mask=mask)

    @triton.jit
    def _block_quant_2pass_kernel(
        w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, stride_sn,
        FP8_MAX: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HINTS: tl.constexpr,
        TILES: tl.constexpr = 1, K_FIRST: tl.constexpr = 0,
    ):
        # TILES consecutive BLOCK x BLOCK weight tiles of one block row per program, each walked in
        # ROWS-row slices twice: the amax pass reads HBM, the cast pass re-reads the tile (BLOCK^2 * 2
        # bytes, resident in L2). HINTS: keep the tile in L2 after the first read, drop it after the
        # second, stream q out. Tiles past K are fully masked (no loads; their scale is not stored).
        # K_FIRST: the grid's fastest axis walks a block row, so programs resident together read
        # neighbouring 256-byte pieces of the same rows rather than tiles one block row apart.
        if K_FIRST:
            pid_k, pid_n = tl.program_id(0), tl.program_id(1)
        else:
            pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        row0 = pid_n.to(tl.int64) * BLOCK  # int64 tile base (N * K may pass 2**31), int32 inside the tile
        w_ptr += row0 * stride_wn
        q_ptr += row0 * stride_qn
        N = N - pid_n * BLOCK  # rows left from row0
        for t in tl.static_range(TILES):
            kb = pid_k * TILES + t
            cols = kb * BLOCK + tl.arange(0, BLOCK)
            acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
            for r in range(0, BLOCK, ROWS):
                rows = r + tl.arange(0, ROWS)
                mask = (rows[:, None] < N) & (cols[None, :] < K)
                x = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_last" if HINTS else "").to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
            amax = tl.max(tl.max(acc, axis=1), axis=0)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
            tl.store(s_ptr + pid_n * stride_sn + kb, scale, mask=kb < K // BLOCK)
            for r in range(0, BLOCK, ROWS):
                rows = r + tl.arange(0, ROWS)
                mask = (rows[:, None] < N) & (cols[None, :] < K)
                x = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first" if HINTS else "").to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
                tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q.to(OUT), mask=mask,
                         cache_modifier=".cs" if HINTS else "")

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK  # int64: n may pass 2**31
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32)
        a = tl.max(tl.abs(x), axis=0)
        tl.atomic_max(amax_ptr, a.to(tl.int32, bitcast=True))  # non-negative floats order like ints

    @triton.jit
    def _scale_cast_kernel(x_ptr, q_ptr, amax_ptr, s_ptr, n, FP8_MAX: tl.constexpr, OUT: tl.constexpr,
                           BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK  # int64: n may pass 2**31
        offs = tl.arange(0, BLOCK)
        mask = offs < n - base
        x_ptr += base
        q_ptr += base
        amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        if pid == 0:
            tl.store(s_ptr, scale)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + offs, q.to(OUT), mask=mask)

    @triton.jit
    def _e2m1_code(v):
        # E2M1 code of v in [-6, 6], round to nearest even. |v| >= 1 is a normal E2M1 number:
        # round the float32 to one mantissa bit in integer arithmetic (add half an ulp minus one plus
        # the kept bit, truncate); the top bits are then (biased exponent, mantissa bit) and the code
        # is that minus (127 << 1) - 2. Below 1 the codes are 0 / 1 (0.5) / 2 (1.0) with ties
        # 0.25 -> 0 and 0.75 -> 2. Sign in bit 3; NaN gives code 0 (as the threshold form did).
        a = tl.abs(v)
        bits = a.to(tl.int32, bitcast=True)
        rounded = bits + 0x1FFFFF + ((bits >> 22) & 1)
        high = (rounded >> 22) - 252
        low = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
        code = tl.where(a < 1.0, low, tl.where(a == a, high, 0))
        return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)

    @triton.jit
    def _e8m0(amax, EMAX: tl.constexpr):
        # OCP MX shared exponent floor(log2(amax)) - EMAX read off the float's exponent field (zero
        # and subnormal amax give the clamped -127, as frexp does): (E8M0 byte, 2**-shared as float)
        exp_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        shared = tl.minimum(tl.maximum(exp_field - 127 - EMAX, -127), 127)
        finite = exp_field != 255
        byte = tl.where(finite, shared + 127, 255)
        used = tl.where(finite, shared, 127)  # the torch path scales NaN blocks by 2**-127 too
        inv_exp = 127 - used  # 2**-used as float bits; 2**-127 is the subnormal 1 << 22
        inv = tl.where(inv_exp > 0, inv_exp << 23, 1 << 22).to(tl.float32, bitcast=True)
        return byte, inv

    @triton.jit
    def _mx_quant_kernel(
        x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
        EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, FP4: tl.constexpr, OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PACK_SUM: tl.constexpr = False,
    ):
        # OCP MX, 32-element blocks; any input dtype (loaded and widened to float32). The row block's
        # base offsets are int64 (M * K may pass 2**31); inside the block int32 (BLOCK_M * stride < 2**31).
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        row0 = pid_m.to(tl.int64) * BLOCK_M
        x_ptr += row0 * stride_xm
        q_ptr += row0 * stride_qm
        s_ptr += row0 * stride_sm
        rows = tl.arange(0, BLOCK_M)
        M = M - pid_m * BLOCK_M  # rows left from row0
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xb = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
        amax = tl.max(tl.abs(xb), axis=2)  # (BLOCK_M, BLOCK_K // 32)
        byte, inv = _e8m0(amax, EMAX)
        v = xb * inv[:, :, None]
        v = tl.minimum(tl.maximum(v, -ELEM_MAX), ELEM_MAX)
        v = tl.reshape(v, (BLOCK_M, BLOCK_K))
        srows = rows[:, None]
        scols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :]
        tl.store(s_ptr + srows * stride_sm + scols, byte.to(tl.uint8),
                 mask=(srows < M) & (scols < tl.cdiv(K, 32)))
        if FP4:
            code = _e2m1_code(v)
            if PACK_SUM:  # odd columns shifted to the high nibble, pairs joined by a size-2 sum
                shift = (tl.arange(0, BLOCK_K) % 2) * 4
                packed = tl.sum(tl.reshape(code << shift[None, :], (BLOCK_M, BLOCK_K // 2, 2)), axis=2).to(tl.uint8)
            else:
                lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
                packed = (lo | (hi << 4)).to(tl.uint8)
            pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
            tl.store(q_ptr + srows * stride_qm + pcols, packed, mask=(srows < M) & (pcols < (K + 1) // 2))
        else:
            tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], v.to(OUT), mask=mask)

    @triton.jit
    def _e2m1_mag16(ax, inv):
        # |E2M1 code| (0..7) of ax * inv, ax >= 0 from a 16-bit float (<= 11 significant
        # bits), RNE, saturating at 6. Times 2**-126 the E2M1 grid lines up with float32's: its
        # subnormal step 0.5 becomes float32's subnormal range and 1.0 the least normal, so one
        # integer rounding of the bits to one mantissa bit (as _e2m1_code does above 1) gives every
        # code. Exact: values < 1 land on the subnormal grid unrounded unless < 2**-12 (code 0 then).
        bits = (ax * inv * 1.1754943508222875e-38).to(tl.int32, bitcast=True)
        # ties to even: + bit 22, fetched as a high multiply (sm_90: one IMAD + LEA.HI instead of
        # two integer-pipe ops for (bits >> 22) & 1, which LLVM would rebuild from a plain shift)
        odd = tl.umulhi((bits << 9).to(tl.uint32, bitcast=True), 2).to(tl.int32, bitcast=True)
        return tl.minimum((bits + 0x1FFFFF + odd) >> 22, 7)  # 8 (ax * inv >= 7) -> 7

    @triton.jit
    def _mx_fp4_words_kernel(
        w_ptr, q_ptr, s_ptr, M, KW, stride_wm, stride_qm, stride_sm,
        EMAX: tl.constexpr, FP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        # MXFP4 for 16-bit x read as int32 words (M, K/2): word j holds element 2j in its low and
        # 2j+1 in its high half (little endian), exactly the two elements of output byte j. Both
        # halves are widened to float32 in registers, a 32-element block is 16 words (a plain
        # reduction over the last axis of a (BLOCK_M, BLOCK_W/16, 16) view) and byte j is built in
        # the thread that loaded word j: no reshuffle between load, pack and the (coalesced) store.
        pid_m = tl.program_id(0)
        pid_w = tl.program_id(1)
        row0 = pid_m.to(tl.int64) * BLOCK_M  # int64 base offsets (M * K / 2 may pass 2**31), int32 inside
        w_ptr += row0 * stride_wm
        q_ptr += row0 * stride_qm
        s_ptr += row0 * stride_sm
        rows = tl.arange(0, BLOCK_M)
        M = M - pid_m * BLOCK_M  # rows left from row0
        cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = (rows[:, None] < M) & (cols[None, :] < KW)
        w = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :], mask=mask, other=0)
        if FP16:
            even = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:  # bf16 is the top half of a float32
            even = (w << 16).to(tl.float32, bitcast=True)
            odd = (w & -65536).to(tl.float32, bitcast=True)
        ae = tl.reshape(tl.abs(even), (BLOCK_M, BLOCK_W // 16, 16))  # one MX block per (row, 16 words)
        ao = tl.reshape(tl.abs(odd), (BLOCK_M, BLOCK_W // 16, 16))
        byte, inv = _e8m0(tl.max(tl.maximum(ae, ao), axis=2), EMAX)  # (BLOCK_M, BLOCK_W // 16)
        mag = _e2m1_mag16(ae, inv[:, :, None]) | (_e2m1_mag16(ao, inv[:, :, None]) << 4)
        # sign bits 15 and 31 to the nibbles' bit 3 (3 and 7) in one high multiply by 2**20 + 2**8
        # (bit 31 also lands on bit 19, which the uint8 cast drops)
        sign = tl.umulhi(w.to(tl.uint32, bitcast=True) & 0x80008000, 0x100100).to(tl.int32, bitcast=True)
        packed = (tl.reshape(mag, (BLOCK_M, BLOCK_W)) | sign).to(tl.uint8)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], packed, mask=mask)
        scols = pid_w * (BLOCK_W // 16) + tl.arange(0, BLOCK_W // 16)[None, :]
        tl.store(s_ptr + rows[:, None] * stride_sm + scols, byte.to(tl.uint8),
                 mask=(rows[:, None] < M) & (scols < KW // 16))

    @triton.jit
    def _block_gemm_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K: tl.constexpr,
        stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            ks = kb * BLOCK_K + offs_k
            kmask = ks < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + ks[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)
            sa = tl.load(sa_ptr + offs_m * stride_sam + kb, mask=mmask, other=0.0)
            sb = tl.load(sb_ptr + (offs_n // 128) * stride_sbn + kb, mask=nmask, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        c = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c, mask=mmask[:, None] & nmask[None, :])


def _require(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed: pip install lumenrl-quant[triton]")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"Triton kernels need a GPU tensor; got device={x.device}")


def _require_pow2(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum or value != _next_pow2(value):
        raise ValueError(f"{name}={value} must be a power of two >= {minimum}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _with(defaults: dict, config: Mapping[str, int] | None) -> dict:
    """Launch parameters: ``defaults`` updated by a caller's ``config`` (benchmark tuning)."""
    if config is None:
        return defaults
    unknown = set(config) - set(defaults)
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)} are not launch parameters; allowed: {sorted(defaults)}")
    return {**defaults, **config}


def _group_defaults(m: int, k: int, group: int) -> dict:
    # measured on an H200 (benchmarks/quant/bench_quantize.py --tune, 8192 x 8192 bf16)
    if group <= 128:  # activation groups: one row x up to 32 groups (4096 columns) per program
        return {"block_m": 1, "ng": min(32, _next_pow2(k // group)), "num_warps": 4}
    if group <= 16384:  # rowwise: whole rows held in registers
        block = _next_pow2(group)
        return {"block_m": 2 if block <= 2048 else 1, "ng": 1, "num_warps": 4 if block <= 2048 else 8}
    return {"block_m": 1, "ng": 1, "num_warps": 8}


def fp8_quantize_groups(
    x: torch.Tensor, group: int, dtype: torch.dtype = torch.float8_e4m3fn, *,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (M, K) with one scale per ``group`` contiguous elements of a row.

    ``config`` overrides the launch parameters ``block_m`` (rows per program), ``ng`` (groups per
    program; > 1 needs a power-of-two ``group``) and ``num_warps``."""
    _require(x)
    m, k = x.shape
    if k % group:
        raise ValueError(f"K={k} must be a multiple of group={group}")
    cfg = _with(_group_defaults(m, k, group), config)
    block_k = _next_pow2(group) if group <= 16384 else 4096
    ng = cfg["ng"]
    _require_pow2("config ng", ng)
    if ng > 1 and block_k != group:
        raise ValueError(f"config ng={ng} needs a power-of-two group; got group={group}")
    x = x.contiguous()
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(k // group, ng))
    _group_quant_kernel[grid](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), group,
        FP8_MAX=fp8_max(dtype), OUT=_tl_fp8(dtype), REDUCE_ROWS=False, BLOCK_M=cfg["block_m"], BLOCK_K=block_k,
        NG=ng, num_warps=cfg["num_warps"],
    )
    return q, s


def fp8_quantize_blocks(
    w: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float8_e4m3fn, *,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (N, K) in ``block x block`` tiles; scales ``(ceil(N/block), K/block)``.

    ``config`` overrides ``impl`` (``"tile"``: the tile held in registers, ``ng`` tiles per program;
    ``"2pass"``: the tile walked in ``rows``-row slices, amax then cast; ``hints``: L2 eviction
    and streaming-store hints; ``tiles``: consecutive tiles of a block row per program, 1 fastest on
    the H200; ``k_first``: 1 (default) launches the grid block-row-major, neighbouring programs on
    neighbouring tiles of the same rows, 0 block-column-major), ``num_warps`` and ``num_stages``."""
    _require(w)
    n, k = w.shape
    if k % block:
        raise ValueError(f"K={k} must be a multiple of block={block}")
    _require_pow2("block", block)
    cfg = _with({"impl": "2pass", "ng": 1, "rows": 64, "num_warps": 8, "num_stages": 3, "hints": 1, "tiles": 1,
                 "k_first": 1}, config)  # H200 --tune (entry quantize)
    if cfg["impl"] not in ("tile", "2pass"):
        raise ValueError(f"config impl={cfg['impl']!r}; allowed: ['tile', '2pass']")
    _require_pow2("config ng", cfg["ng"])
    w = w.contiguous()
    q = torch.empty((n, k), dtype=dtype, device=w.device)
    s = torch.empty((triton.cdiv(n, block), k // block), dtype=torch.float32, device=w.device)
    if cfg["impl"] == "2pass":
        if block % cfg["rows"] or cfg["rows"] != _next_pow2(cfg["rows"]):
            raise ValueError(f"config rows={cfg['rows']} must be a power of two dividing block={block}")
        _require_pow2("config tiles", cfg["tiles"])
        if cfg["k_first"] not in (0, 1):
            raise ValueError(f"config k_first={cfg['k_first']!r}; allowed: 0 (block-column-major grid) or 1 (row-major)")
        grid = (triton.cdiv(n, block), triton.cdiv(k // block, cfg["tiles"]))
        _block_quant_2pass_kernel[grid[::-1] if cfg["k_first"] else grid](
            w, q, s, n, k, w.stride(0), q.stride(0), s.stride(0), FP8_MAX=fp8_max(dtype), OUT=_tl_fp8(dtype),
            BLOCK=block, ROWS=cfg["rows"], HINTS=bool(cfg["hints"]), TILES=cfg["tiles"], K_FIRST=cfg["k_first"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        return q, s
    grid = (triton.cdiv(n, block), triton.cdiv(k // block, cfg["ng"]))
    _group_quant_kernel[grid](
        w, q, s, n, k, w.stride(0), q.stride(0), s.stride(0), block,
        FP8_MAX=fp8_max(dtype), OUT=_tl_fp8(dtype), REDUCE_ROWS=True, BLOCK_M=block,
        BLOCK_K=block, NG=cfg["ng"], num_warps=cfg["num_warps"],
    )
    return q, s


def fp8_quantize_tensorwise(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise FP8: an amax pass and a cast pass (the cast kernel derives the scale); scale ``()``.

    ``config`` overrides ``amax_block``, ``amax_warps``, ``cast_block`` and ``cast_warps``."""
    _require(x)
    cfg = _with({"amax_block": 32768, "amax_warps": 16, "cast_block": 4096, "cast_warps": 8}, config)  # H200 --tune
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    _amax_kernel[(triton.cdiv(n, cfg["amax_block"]),)](
        flat, amax_bits, n, BLOCK=cfg["amax_block"], num_warps=cfg["amax_warps"])
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    _scale_cast_kernel[(triton.cdiv(n, cfg["cast_block"]),)](
        flat, q.reshape(-1), amax_bits, scale, n, FP8_MAX=fp8_max(dtype), OUT=_tl_fp8(dtype),
        BLOCK=cfg["cast_block"], num_warps=cfg["cast_warps"],
    )
    return q, scale


_MX_PARAMS = {"e4m3": (8, 448.0), "e5m2": (15, 57344.0), "e2m1": (2, 6.0)}


def mx_quantize(
    x: torch.Tensor, elem_format: str = "e4m3", *, config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``x`` (M, K) with K % 32 == 0: ``(data, scale_bytes)`` as :func:`lumenrl_quant.mx.quantize_mx`
    stores them (fp8 elements, or E2M1 codes packed two per byte, low nibble first).

    ``config`` overrides ``block_m`` (rows per program), ``block_k`` (elements per program, a power
    of two >= 32), ``num_warps`` and, for E2M1, ``impl`` - how the two codes of a byte meet:

    * ``"words"`` (default for bf16 / fp16 x): x read as int32 words, each holding exactly the two
      elements of one output byte; both halves are widened in the thread that loaded the word, so
      loads, packing and the byte store share one register layout (sm_90: no shared-memory round
      trip for the codes, 8-16 byte vector stores). Its E2M1 rounding is one integer rounding of
      ``|x| * scale * 2**-126`` (exact for <= 11 significant bits): ~14 SASS ops per element
      (~8 on the half-rate integer pipe) vs ~31 for "split" and ~10 for MXFP8;
    * ``"split"`` (any dtype; the default for float32 x): the codes tile reshaped to pairs and
      ``tl.split``; on sm_90 a layout conversion through shared memory (3 barrier-separated rounds
      per tile) and byte-wise stores: 41% of copy bandwidth on the H200 (MXFP8: 101%);
    * ``"sum"``: as split, odd codes shifted and each pair summed (39-41%).

    All three share the scale math and give identical bytes (NaN inputs aside)."""
    _require(x)
    if elem_format not in _MX_PARAMS:
        raise ValueError(f"elem_format={elem_format!r}; allowed: {sorted(_MX_PARAMS)}")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    emax, elem_max = _MX_PARAMS[elem_format]
    fp4 = elem_format == "e2m1"
    half = x.dtype in (torch.bfloat16, torch.float16)
    # H200 --tune at 8192^2 (entry quantize): MXFP8 2 x 2048 / 8 warps; MXFP4 words of bf16 4 x 1024 /
    # 4 warps, of fp16 2 x 2048 / 8 warps
    words_bf16 = fp4 and x.dtype == torch.bfloat16 and (config or {}).get("impl", "words") == "words"
    cfg = _with({"impl": "words" if half else "split", "block_m": 4 if words_bf16 else 2,
                 "block_k": min(1024 if words_bf16 else 2048, _next_pow2(k)), "num_warps": 4 if words_bf16 else 8},
                config)
    if cfg["impl"] not in ("words", "split", "sum"):
        raise ValueError(f"config impl={cfg['impl']!r}; allowed: ['words', 'split', 'sum']")
    if fp4 and cfg["impl"] == "words" and not half:
        raise ValueError(f"config impl='words' needs bfloat16 / float16 x; got dtype={x.dtype} (use 'split')")
    _require_pow2("config block_k", cfg["block_k"], 32)
    _require_pow2("config block_m", cfg["block_m"])
    _require_pow2("config num_warps", cfg["num_warps"])
    x = x.contiguous()
    out_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(elem_format, torch.uint8)
    q = torch.empty((m, k // 2 if fp4 else k), dtype=out_dtype, device=x.device)
    s = torch.empty((m, k // 32), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(k, cfg["block_k"]))
    if fp4 and cfg["impl"] == "words":
        if x.storage_offset() % 2 or x.stride(0) % 2:  # words on 4-byte boundaries (an M=1 view of an
            x = x.clone(memory_format=torch.contiguous_format)  # odd-width tensor is "contiguous", stride odd)
        w = x.view(torch.int32)  # (M, K/2), little endian: element 2j in the low half of word j
        _mx_fp4_words_kernel[grid](
            w, q, s, m, k // 2, w.stride(0), q.stride(0), s.stride(0), EMAX=emax, FP16=x.dtype == torch.float16,
            BLOCK_M=cfg["block_m"], BLOCK_W=cfg["block_k"] // 2, num_warps=cfg["num_warps"],
        )
        return q, s
    _mx_quant_kernel[grid](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), EMAX=emax, ELEM_MAX=elem_max, FP4=fp4,
        OUT=tl.uint8 if fp4 else _tl_fp8(out_dtype), BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"],
        PACK_SUM=cfg["impl"] == "sum", num_warps=cfg["num_warps"],
    )
    return q, s


def _gemm_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a problem of M rows and N columns."""
    if m <= 16:
        return 16, (32 if n <= 8192 else 64), 4, 4
    if m <= 32:
        return 32, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def fp8_blockwise_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale).T`` for 1x128 ``a_scale (M, K/128)`` and 128x128
    ``b_scale (N/128, K/128)``; ``tiles`` overrides ``(BLOCK_M, BLOCK_N, warps, stages)``."""
    _require(a_q)
    (m, k), n = a_q.shape, b_q.shape[0]
    if b_q.shape[1] != k or k % 128:
        raise ValueError(f"need a (M, K), b (N, K) with K % 128 == 0; got {tuple(a_q.shape)}, {tuple(b_q.shape)}")
    a_q, b_q = a_q.contiguous(), b_q.contiguous()
    sa, sb = a_scale.float().contiguous(), b_scale.float().contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    bm, bn, warps, stages = tiles or _gemm_tiles(m, n)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _block_gemm_kernel[grid](
        a_q, b_q, c, sa, sb, m, n, k, a_q.stride(0), b_q.stride(0), c.stride(0), sa.stride(0), sb.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=warps, num_stages=stages,
    )
    return c
