"""OCP Microscaling (MX) formats: MXFP8 (E4M3 / E5M2 elements) and MXFP4 (E2M1 elements).

Design
------
Follows the OCP MX v1.0 spec. The last dim is cut into blocks of 32 elements; each block
shares one E8M0 scale (an 8-bit biased power-of-two exponent, bias 127, 0xFF = NaN):

    shared_exp = floor(log2(amax_block)) - emax_elem        clamped to [-127, 127]
    scale      = 2 ** shared_exp                              stored as uint8 shared_exp + 127
    element    = RNE(saturate(x / scale, ±elem_max))          dequantized x ≈ element * scale

=========  ========  ==========  ==============================================
element    emax      elem_max    values
=========  ========  ==========  ==============================================
``e4m3``   8         448         ``torch.float8_e4m3fn``
``e5m2``   15        57344       ``torch.float8_e5m2``
``e2m1``   2         6           0, 0.5, 1, 1.5, 2, 3, 4, 6 (and negatives), 4-bit codes
=========  ========  ==========  ==============================================

``floor(log2(amax))`` is computed exactly with ``frexp`` (no float log rounding). An all-zero
block gets ``shared_exp = -127`` (scale byte 0). A block whose amax is NaN or Inf gets the NaN
scale 0xFF (our choice for Inf, which the spec leaves to implementations), so it dequantizes to NaN.

E2M1 codes are ``sign << 3 | exp << 1 | mantissa``; rounding is round-to-nearest-even on the
code (ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Two codes
are packed per byte, the first (even-index) element in the low nibble.

Scales are stored as ``uint8`` (portable across torch versions; view as ``torch.float8_e8m0fnu``
where it exists). Non-divisible ``K`` is zero-padded to whole blocks internally; :class:`MXTensor`
keeps the original shape, MXFP8 data is returned unpadded ``(..., K)``, MXFP4 data packed
``(..., ceil(K/2))`` bytes. No MX tensor-core path exists on Hopper: matmuls dequantize (emulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "MX_BLOCK_SIZE",
    "MX_ELEM_FORMATS",
    "MXElemFormat",
    "MXTensor",
    "dequantize_mx",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_to_float",
    "mx_shared_exponent",
    "pack_fp4",
    "quantize_mx",
    "unpack_fp4",
]

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True, slots=True)
class MXElemFormat:
    """An MX element format: name, emax (largest normal exponent), largest magnitude, torch dtype."""

    name: str
    emax: int
    max: float
    dtype: torch.dtype | None  # None for E2M1 (stored as 4-bit codes)


MX_ELEM_FORMATS: dict[str, MXElemFormat] = {
    "e4m3": MXElemFormat(name="e4m3", emax=8, max=448.0, dtype=torch.float8_e4m3fn),
    "e5m2": MXElemFormat(name="e5m2", emax=15, max=57344.0, dtype=torch.float8_e5m2),
    "e2m1": MXElemFormat(name="e2m1", emax=2, max=6.0, dtype=None),
}

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # ties whose even neighbour is the upper code


_TABLES: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A cached constant tensor (no host-to-device copy per call: CUDA-graph capturable)."""
    key = (values, device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def _elem_format(elem_format: str) -> MXElemFormat:
    if elem_format not in MX_ELEM_FORMATS:
        raise ValueError(f"elem_format={elem_format!r} is not an MX element format; allowed: {sorted(MX_ELEM_FORMATS)}")
    return MX_ELEM_FORMATS[elem_format]


@dataclass(frozen=True, slots=True)
class MXTensor:
    """An MX-quantized tensor. ``data``: fp8 ``(..., K)`` or packed uint8 ``(..., ceil(K/2))``;
    ``scale``: uint8 E8M0 ``(..., ceil(K/32))``; ``shape``: the original shape."""

    data: torch.Tensor
    scale: torch.Tensor
    elem_format: str
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(self, dtype=dtype)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float values (already saturated to ±6) to E2M1 4-bit codes (uint8), RNE."""
    a = v.abs().float()
    bounds = _table(_E2M1_BOUNDS, v.device)
    code = torch.bucketize(a, bounds, right=False)  # ties go to the lower code
    ties_up = torch.zeros_like(a, dtype=torch.bool)
    for t in _E2M1_TIES_UP:
        ties_up |= a == t
    code = (code + ties_up.to(code.dtype)).clamp_(0, 7)
    sign = torch.signbit(v).to(code.dtype) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 4-bit codes (uint8, one per element) to float32 values."""
    table = _table(_E2M1_VALUES + tuple(-x for x in _E2M1_VALUES), codes.device)
    return table[codes.long() & 0xF]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``(..., K)`` two per byte ``(..., ceil(K/2))``; element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``(..., B)`` bytes to ``(..., k)`` codes (``k`` defaults to 2B)."""
    k = 2 * packed.shape[-1] if k is None else k
    if not 2 * packed.shape[-1] - 1 <= k <= 2 * packed.shape[-1]:
        raise ValueError(f"k={k} does not fit packed last dim {packed.shape[-1]} (allowed {2 * packed.shape[-1] - 1}..)")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :k]


def mx_shared_exponent(amax: torch.Tensor, elem_format: str) -> torch.Tensor:
    """E8M0 scale bytes (uint8) for block amaxes: floor(log2(amax)) - emax, clamped, NaN -> 0xFF."""
    fmt = _elem_format(elem_format)
    amax = amax.float()
    _, exponent = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1) -> floor(log2(amax)) = e - 1
    shared = (exponent.to(torch.int32) - 1 - fmt.emax).clamp_(-127, 127)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -127))
    biased = shared + E8M0_BIAS
    return torch.where(torch.isfinite(amax), biased, torch.full_like(biased, E8M0_NAN)).to(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to float32 scales ``2 ** (byte - 127)``; 0xFF is NaN."""
    exp = scale.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return torch.where(scale == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    pad = (-k) % MX_BLOCK_SIZE
    xp = F.pad(x.float(), (0, pad)) if pad else x.float()
    return xp.reshape(*x.shape[:-1], -1, MX_BLOCK_SIZE)  # (..., Kb, 32)


def quantize_mx(x: torch.Tensor, elem_format: str = "e4m3", *, backend: str = "auto") -> MXTensor:
    """Quantize ``x`` (..., K) to MX with 32-element blocks along the last dim (see module doc).

    ``backend``: ``"auto"`` (one-pass Triton kernel on GPU when available and K % 32 == 0, else
    torch), ``"torch"`` or ``"triton"``; both give identical bytes.
    """
    fmt = _elem_format(elem_format)
    if x.dim() < 1:
        raise ValueError(f"quantize_mx needs x with >= 1 dim (..., K); got shape {tuple(x.shape)}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} is not supported; allowed: ['auto', 'torch', 'triton']")
    k = x.shape[-1]
    if backend != "torch":
        from lumenrl_quant import triton_kernels as tk

        if tk.triton_available(x.device) and k % MX_BLOCK_SIZE == 0 and x.numel() > 0:
            data, scale = tk.mx_quantize(x.reshape(-1, k), elem_format)
            return MXTensor(data=data.reshape(*x.shape[:-1], -1), scale=scale.reshape(*x.shape[:-1], -1),
                            elem_format=elem_format, shape=x.shape)
        if backend == "triton":
            raise RuntimeError(f"backend='triton' needs triton, a GPU tensor and K % 32 == 0; got device="
                               f"{x.device}, K={k}")
    xb = _blocks(x)
    scale = mx_shared_exponent(xb.abs().amax(dim=-1), elem_format)  # (..., Kb) uint8
    exp = (scale.to(torch.int32) - E8M0_BIAS).clamp_(-127, 127)
    v = torch.ldexp(xb, -exp.unsqueeze(-1)).clamp_(-fmt.max, fmt.max)  # exact power-of-two scaling
    v = v.reshape(*x.shape[:-1], -1)[..., :k]
    data = pack_fp4(e2m1_encode(v)) if fmt.dtype is None else v.to(fmt.dtype)
    return MXTensor(data=data, scale=scale, elem_format=elem_format, shape=x.shape)


def dequantize_mx(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize an :class:`MXTensor` to ``dtype`` with its original shape."""
    fmt = _elem_format(t.elem_format)
    k = t.shape[-1]
    v = e2m1_decode(unpack_fp4(t.data, k)) if fmt.dtype is None else t.data.float()
    pad = (-k) % MX_BLOCK_SIZE
    vb = F.pad(v, (0, pad)).reshape(*t.shape[:-1], -1, MX_BLOCK_SIZE)
    out = (vb * e8m0_to_float(t.scale).unsqueeze(-1)).reshape(*t.shape[:-1], -1)[..., :k]
    return out.to(dtype)
