"""Quantized linear layer for rollout (inference), with in-place requantization on weight sync.

Design
------
:class:`QuantizedLinear` replaces an ``nn.Linear`` (weight ``(N, K)``) at inference. Schemes:

============  ===============================  ===================================  ==================
scheme        weight buffers                   activations (dynamic, per call)      matmul
============  ===============================  ===================================  ==================
fp8_block     fp8 ``(N, K)``, fp32 128x128     fp8, 1x128 per-token-group scales    ``scaled_mm``
              block scales ``(⌈N/128⌉, ⌈K/128⌉)``
fp8_row       fp8, fp32 ``(N, 1)`` per channel  fp8, per-token ``(M, 1)``             ``scaled_mm``
fp8_tensor    fp8, fp32 ``()``                  fp8, one scale per call               ``scaled_mm``
fp8_w8a16     fp8, fp32 ``(N, 1)`` per channel  unquantized (weight-only)            Triton W8A16 / dequantize
mxfp8         fp8 e4m3, E8M0 uint8 ``(N, ⌈K/32⌉)``  MXFP8 e4m3 (quantize-dequantize)   emulated (dequantize)
mxfp4         packed uint8 ``(N, ⌈K/2⌉)``, E8M0  unquantized (weight-only)            emulated (dequantize)
============  ===============================  ===================================  ==================

Scales are dequant scales (``x ≈ q * scale``, see :mod:`lumenrl_quant.fp8`). The quantized
weight is the buffer ``weight`` and its scale ``weight_scale``, so state-dict names match the
original model's. :meth:`QuantizedLinear.reload_` requantizes a new high-precision weight
*into the existing buffers* (``copy_``, same storage and ``data_ptr``), which keeps CUDA graphs
and engine-held pointers valid across weight syncs. FP8 math follows :func:`scaled_mm`'s path
choice; MX matmuls dequantize to the activation dtype (no MX tensor cores on Hopper).

Decode and ``torch.compile``
----------------------------
The GEMM path of each (activation dtype, M class) is chosen once, when the module is built or
moved (``_apply``), with :func:`~lumenrl_quant.gemm.gemm_path` on zero-size stand-in operands, and
kept in a plain dict; ``forward`` only looks it up and runs it with
:func:`~lumenrl_quant.gemm.run_gemm_path`. Inside ``torch.compile`` (``torch.compiler.is_compiling()``)
the dynamic activation quantization is the plain-torch version (amax over the row / group, scale,
clamp, cast), which inductor fuses into the producer of ``x`` (RMSNorm, SiLU * up, ...), instead
of a separate Triton launch; the forward then has no ``.item()``, no Triton launch outside
registered ops and no Python-side state change, so dynamo traces it with ``fullgraph=True``
(tested on CPU). Eager / CUDA-graph mode uses the fused Triton quantize kernel (one launch).
``fp8_row`` at decode M runs the ``scaled_mm_rowwise_epilogue`` path (see :mod:`lumenrl_quant.gemm`).
``fp8_w8a16`` keeps 16-bit activations (no per-call quantization, no activation rounding): at decode
M (<= ``W8A16_MAX_M`` = 256) on CUDA with Triton its path is ``triton_w8a16`` (the FP8 weight widened in
registers, :func:`lumenrl_quant.triton_gemm.fp8_weight_only_gemm`), otherwise ``dequantize`` (the
weight dequantized to the activation dtype, then ``F.linear``: prefill, CPU, float32 activations).
A fast path that raises at runtime (eager only) is remembered (:func:`~lumenrl_quant.gemm.note_gemm_failure`,
one warning) and the next best path runs instead (e.g. the rowwise kernel for the rowwise
epilogue, finally the emulation); every layer re-checks its paths while such a failure is recorded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_quant import gemm
from lumenrl_quant.formats import fp8_dtypes_for, fp8_format
from lumenrl_quant.fp8 import dequantize_fp8, quantize_fp8
from lumenrl_quant.gemm import gemm_path, note_gemm_failure, run_gemm_path
from lumenrl_quant.mx import MXTensor, dequantize_mx, quantize_mx

__all__ = ["LINEAR_SCHEMES", "QuantizedLinear"]

# scheme -> (weight granularity, weight block, activation granularity (None: weight-only), activation block)
_FP8_LAYOUTS: dict[str, tuple[str, tuple[int, int] | None, str | None, tuple[int, int] | None]] = {
    "fp8_block": ("block", (128, 128), "block", (1, 128)),
    "fp8_row": ("rowwise", None, "rowwise", None),
    "fp8_tensor": ("tensorwise", None, "tensorwise", None),
    "fp8_w8a16": ("rowwise", None, None, None),  # weight-only: activations stay 16-bit
}
W8A16_MAX_M = 256  # decode M that takes the Triton W8A16 kernel (64-row tiles to 64, then 128); larger M dequantizes
_MX_ELEMS = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
LINEAR_SCHEMES: tuple[str, ...] = (*_FP8_LAYOUTS, *_MX_ELEMS)
# representatives of the M classes gemm_path distinguishes (blockwise: M < 4 / <= 16 / more;
# rowwise: < 33 / 33..64 (the Triton rowwise kernel's tuned shapes) / <= 256 / more); _m_class maps an M
# to its representative
_M_CLASSES: tuple[int, ...] = (1, 4, 17, 33, 65, 257)
_OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


# launch configurations of the W8A16 kernel per (N, K); others use triton_gemm.DEFAULT_CONFIG. Best of
# ``benchmarks/quant/bench_decode_gemm.py --tune`` for bf16 x at M = 64 on an H200; slower than bf16
# there (the scheme is for memory).
_W8A16_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (6144, 4096): {"block_m": 64, "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 3},
    (4096, 4096): {"block_m": 64, "block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 4},
    (24576, 4096): {"block_m": 64, "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 3},
    (4096, 12288): {"block_m": 64, "block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 4},
}


def _w8a16_ok(weight: torch.Tensor, dtype: torch.dtype, m: int) -> bool:
    """The Triton W8A16 kernel runs here: CUDA sm_89+, Triton, 16-bit activations, decode M, K % 128 == 0."""
    if weight.device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or m > W8A16_MAX_M:
        return False
    if getattr(torch.version, "hip", None) is not None or weight.shape[1] % 128:
        return False
    from lumenrl_quant import triton_kernels as tk

    return tk.triton_available(weight.device) and torch.cuda.get_device_capability(weight.device) >= (8, 9)


def _m_class(m: int) -> int:
    return next(c for c in reversed(_M_CLASSES) if m >= c)


def _scheme_name(scheme: object) -> str:
    name = scheme if isinstance(scheme, str) else getattr(scheme, "name", None)
    if name not in LINEAR_SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not a linear quantization scheme; allowed: {list(LINEAR_SCHEMES)}")
    return name


def _check_fp8_dtype(scheme: str, fp8_dtype: torch.dtype | None) -> None:
    """Refuse an ``fp8_dtype`` for the MX schemes: their elements are fixed by the scheme (E4M3 / E2M1 with
    E8M0 block scales), so the dtype would be accepted and ignored."""
    if scheme in _MX_ELEMS and fp8_dtype is not None:
        raise ValueError(f"fp8_dtype={fp8_dtype} has no effect with scheme={scheme!r} (MX elements are "
                         f"{_MX_ELEMS[scheme]}); allowed: fp8_dtype=None, or an FP8 scheme {list(_FP8_LAYOUTS)}")


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored quantized (see module doc for the schemes)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        scheme: str = "fp8_block",
        bias: bool = True,
        fp8_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight: torch.Tensor | None = None,
    ) -> None:
        """``weight``: the high-precision ``(N, K)`` weight to start from (zeros when None). ``fp8_dtype``: the
        FP8 schemes' element dtype (default E4M3, fnuz on MI300); the MX schemes refuse one, and their
        ``fp8_dtype`` attribute is None."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = _scheme_name(scheme)
        _check_fp8_dtype(self.scheme, fp8_dtype)
        self.fp8_dtype: torch.dtype | None = None
        if self.scheme in _FP8_LAYOUTS:
            self.fp8_dtype = fp8_dtype if fp8_dtype is not None else fp8_dtypes_for(device).e4m3
            fp8_format(self.fp8_dtype)  # validates
        if weight is None:
            weight = torch.zeros(out_features, in_features, device=device)
        self._check_weight_shape(weight)
        weight, scale = self._quantize(weight.detach().to(device))
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        # programmatic dependent launch for the Triton rowwise decode GEMM (CUDA sm90+; an engine that chains
        # PDL kernels sets it): see lumenrl_quant.triton_gemm.fp8_rowwise_gemm. Plain attribute, not state.
        self.pdl = False
        self.pdl_prefetch = 512  # bytes of each weight row prefetched to L2 before the PDL wait
        self.tma = False  # that GEMM copies its tiles with the tensor memory accelerator (sm90+; the same bits)
        self._select_paths()

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: object = "fp8_block", *, fp8_dtype: torch.dtype | None = None
    ) -> QuantizedLinear:
        """Quantize an ``nn.Linear`` (its weight is not modified)."""
        module = cls(
            linear.in_features, linear.out_features, scheme=_scheme_name(scheme), bias=linear.bias is not None,
            fp8_dtype=fp8_dtype, device=linear.weight.device, weight=linear.weight,
        )
        if linear.bias is not None:
            module.bias.data = linear.bias.detach().clone()
        return module

    def _check_weight_shape(self, weight: torch.Tensor) -> None:
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match this layer's {expected}")

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scheme in _MX_ELEMS:
            t = quantize_mx(weight, _MX_ELEMS[self.scheme])
            return t.data, t.scale
        gran, block, _, _ = _FP8_LAYOUTS[self.scheme]
        return quantize_fp8(weight, dtype=self.fp8_dtype, granularity=gran, block_size=block)

    def _select_paths(self) -> None:
        """Pick the GEMM path per (activation dtype, M class) for the weight's current device."""
        self._paths: dict[tuple[torch.dtype, int], str] = {}
        if self.scheme not in _FP8_LAYOUTS:
            return
        self._unit = torch.ones((), dtype=torch.float32, device=self.weight.device)  # plain attribute, not state
        for m in _M_CLASSES:
            for dtype in _OUT_DTYPES:
                self._paths[(dtype, m)] = self._path_now(dtype, m)

    def _path_now(self, dtype: torch.dtype, m: int) -> str:
        """:func:`gemm_path` for ``m`` rows of ``dtype`` activations, on zero-size stand-in operands."""
        _, w_block, a_gran, a_block = _FP8_LAYOUTS[self.scheme]
        dev = self.weight.device
        if a_gran is None:  # weight-only
            return "triton_w8a16" if _w8a16_ok(self.weight, dtype, m) else "dequantize"
        a_q = torch.empty((), dtype=self.fp8_dtype, device=dev).expand(m, self.in_features)  # no allocation
        a_scale = torch.empty((), device=dev)
        a_scale = a_scale.expand(m, 1) if a_gran == "rowwise" else a_scale  # block: a_block_size decides
        return gemm_path(a_q, a_scale, self.weight, self.weight_scale, out_dtype=dtype, a_block_size=a_block,
                         b_block_size=w_block)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        self._select_paths()  # the device may have changed
        return self

    def gemm_path_for(self, m: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """The GEMM path ``forward`` takes for ``m`` rows of ``dtype`` activations."""
        return self._paths.get((dtype, _m_class(m)), "emulated")

    @torch.no_grad()
    def reload_(self, weight: torch.Tensor) -> QuantizedLinear:
        """Requantize a new high-precision ``(N, K)`` weight in place into the existing buffers."""
        self._check_weight_shape(weight)
        q, scale = self._quantize(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the layer sees it, ``(N, K)`` in ``dtype``."""
        if self.scheme in _MX_ELEMS:
            shape = torch.Size((self.out_features, self.in_features))
            return dequantize_mx(MXTensor(self.weight, self.weight_scale, _MX_ELEMS[self.scheme], shape), dtype)
        return dequantize_fp8(self.weight, self.weight_scale, block_size=_FP8_LAYOUTS[self.scheme][1], dtype=dtype)

    def rounded_input(self, x2: torch.Tensor) -> torch.Tensor:
        """Activations (M, K) as this scheme rounds them before its GEMM (quantized, then dequantized to
        ``x2``'s dtype; unchanged for weight-only schemes), in plain torch ops: a token's values depend on
        that token only, except ``fp8_tensor``'s (one scale per call). ``forward`` equals
        ``F.linear(rounded_input(x), dequantized_weight())`` up to the GEMM's summation order."""
        if self.scheme == "mxfp8":
            return quantize_mx(x2, "e4m3").dequantize(x2.dtype)
        if self.scheme not in _FP8_LAYOUTS or _FP8_LAYOUTS[self.scheme][2] is None:
            return x2
        _, _, a_gran, a_block = _FP8_LAYOUTS[self.scheme]
        a_q, a_scale = quantize_fp8(x2, dtype=self.fp8_dtype, granularity=a_gran, block_size=a_block, backend="torch")
        return dequantize_fp8(a_q, a_scale, block_size=a_block, dtype=x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        if self.scheme in _FP8_LAYOUTS and _FP8_LAYOUTS[self.scheme][2] is None:
            out = self._weight_only_forward(x2)
        elif self.scheme in _FP8_LAYOUTS:
            out = self._fp8_forward(x2)
        else:
            if self.scheme == "mxfp8":
                x2 = quantize_mx(x2, "e4m3").dequantize(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out = F.linear(x2, self.dequantized_weight(x.dtype), bias)
        return out.reshape(*lead, self.out_features)

    def _weight_only_forward(self, x2: torch.Tensor) -> torch.Tensor:
        path = self._paths.get((x2.dtype, _m_class(x2.shape[0])), "dequantize")
        m = x2.shape[0]
        if path == "triton_w8a16" and m <= W8A16_MAX_M:
            from lumenrl_quant import triton_gemm

            # the tuned configs are for one 64-row tile; 128-row tiles take the default (their shared memory
            # at block_k 256 x 4 stages passes the H200's 227 KiB: measured OutOfResources)
            config = _W8A16_CONFIGS.get(tuple(self.weight.shape), {}) if m <= 64 else {"block_m": 128}
            return triton_gemm.fp8_weight_only_gemm(x2, self.weight, self.weight_scale, out_dtype=x2.dtype,
                                                    bias=self.bias, config=config)
        bias = None if self.bias is None else self.bias.to(x2.dtype)
        return F.linear(x2, self.dequantized_weight(x2.dtype), bias)

    def _fp8_forward(self, x2: torch.Tensor) -> torch.Tensor:
        _, _, a_gran, a_block = _FP8_LAYOUTS[self.scheme]
        backend = "torch" if torch.compiler.is_compiling() else "auto"  # plain torch ops fuse into the producer
        a_q, a_scale = quantize_fp8(x2, dtype=self.fp8_dtype, granularity=a_gran, block_size=a_block, backend=backend)
        return self._fp8_gemm(a_q, a_scale, x2.dtype)

    def forward_quantized(self, a_q: torch.Tensor, a_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``forward`` for activations the caller already quantized as this scheme's activations are:
        ``fp8_row`` only, ``a_q`` (..., K) in this layer's FP8 dtype and ``a_scale`` (..., 1) per-token
        dequant scales (e.g. :func:`lumenrl_quant.fused_mlp.silu_mul_quantize` of the layer before)."""
        if self.scheme != "fp8_row":
            raise ValueError(f"forward_quantized: scheme={self.scheme!r}; allowed: 'fp8_row' (per-token activations)")
        if a_q.dtype != self.fp8_dtype or a_q.shape[-1] != self.in_features:
            raise ValueError(f"forward_quantized: a_q {a_q.dtype} (..., {a_q.shape[-1]}); this layer takes "
                             f"{self.fp8_dtype} (..., {self.in_features})")
        if tuple(a_scale.shape) != (*a_q.shape[:-1], 1):
            raise ValueError(f"forward_quantized: a_scale shape {tuple(a_scale.shape)}; allowed: "
                             f"{(*a_q.shape[:-1], 1)} (one scale per token)")
        lead = a_q.shape[:-1]
        a2, s2 = a_q.reshape(-1, self.in_features), a_scale.reshape(-1, 1)
        if a2.shape[0] == 0:
            return torch.zeros(*lead, self.out_features, dtype=out_dtype, device=a_q.device)
        return self._fp8_gemm(a2, s2, out_dtype).reshape(*lead, self.out_features)

    def _fp8_gemm(self, a_q: torch.Tensor, a_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        _, w_block, _, a_block = _FP8_LAYOUTS[self.scheme]
        key = (out_dtype, _m_class(a_q.shape[0]))
        path = self._paths.get(key, "emulated")
        kw = {"out_dtype": out_dtype, "bias": self.bias, "a_block_size": a_block, "b_block_size": w_block,
              "unit_scale": self._unit, "pdl": getattr(self, "pdl", False),
              "pdl_prefetch": getattr(self, "pdl_prefetch", 512), "tma": getattr(self, "tma", False)}
        if torch.compiler.is_compiling():
            return run_gemm_path(path, a_q, a_scale, self.weight, self.weight_scale, **kw)
        if gemm._FAILED and path != "emulated":  # a fast path failed somewhere: re-check (slow, rare, correct)
            path = self._paths[key] = self._path_now(out_dtype, a_q.shape[0])
        for _ in range(3):  # a failing path is remembered; gemm_path then names the next best one
            if path == "emulated":
                break
            try:
                return run_gemm_path(path, a_q, a_scale, self.weight, self.weight_scale, **kw)
            except (RuntimeError, NotImplementedError) as err:
                note_gemm_failure(path, a_q, self.weight, out_dtype, err)
                path = self._paths[key] = self._path_now(out_dtype, a_q.shape[0])
        return run_gemm_path("emulated", a_q, a_scale, self.weight, self.weight_scale, **kw)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"bias={self.bias is not None}")
