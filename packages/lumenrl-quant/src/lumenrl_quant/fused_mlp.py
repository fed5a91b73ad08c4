"""SwiGLU MLP in FP8 with the down projection's input quantized inside the gate/up GEMM.

``down(silu(x @ W_gate.T) * (x @ W_up.T))`` where the gate/up projection is one ``fp8_row``
:class:`~lumenrl_quant.QuantizedLinear` over ``cat([W_gate, W_up])`` (as the native engine fuses it)
and ``down`` is another ``fp8_row`` layer.

Why: at decode the unfused FP8 MLP is five kernels per layer: the gate/up GEMM writes (M, 2I) in
bf16; SiLU * up, its per-token amax (a reduction over I = 12288 features that inductor splits in
two kernels for M = 64 rows) and the FP8 cast follow; then the down GEMM. Those three middle kernels cost
time per layer on every decode step.
Here the gate/up kernel (:func:`lumenrl_quant.triton_gemm.fp8_swiglu_quant`) computes ``group``
features of both halves per program, applies SiLU * up to its float32 accumulators and quantizes
the result in 1 x ``group`` blocks, which need no reduction across programs; the down GEMM
(:func:`~lumenrl_quant.triton_gemm.fp8_group_act_gemm`) applies those block scales in its K loop.
Two kernels, and ``h`` never exists in 16 bits.

Measured on an H200 (Qwen3-8B, M = 64; figures: benchmarks/RESULTS.md, entry ``fused_mlp``): the
fusion removes the three kernels' elementwise work, but the gate/up kernel with two accumulators and
the group-scaled down GEMM (the per-K-block scale multiply breaks the MMA accumulate chain) are each
slower than their unfused counterparts, so the engine decodes no faster. The native engine therefore
uses it only when asked
(``quantization.rollout.fuse_mlp``).

Numerics: the down projection's input gets one scale per 1 x ``group`` block instead of one per
token: never a coarser scale than per-token (each block's amax is at most the row's), and ``h`` is
not rounded to bf16 before quantization. Tested against float64 (SQNR) and against the unfused
per-token path (the fused one is at least as close to float64).

Per-token variant, :func:`swiglu_mlp_fp8_tokenwise`: the two GEMMs stay the per-token ``fp8_row``
ones (the tuned Triton rowwise kernel / cuBLAS), and only the three elementwise kernels between them
become one: :func:`silu_mul_quantize` (``triton_swiglu.fp8_silu_mul_quantize``, a program per row
holding the row in registers, so the per-token amax needs no second kernel). Its numerics are those
of the unfused compiled path (``h`` in float32, one scale per token), with ``h`` never rounded to 16 bits.

Backends: ``triton`` (CUDA, sm_89+, Triton) or ``torch`` (the same math with dequantized operands:
CPU, and the reference in tests); ``auto`` picks. Inside ``torch.compile`` the input's per-token
quantization is plain torch ops (inductor fuses them into the RMSNorm that produces ``x``), as in
:class:`~lumenrl_quant.QuantizedLinear`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lumenrl_quant.fp8 import quantize_fp8

__all__ = [
    "SWIGLU_GROUP",
    "silu_mul_quantize",
    "swiglu_mlp_fp8",
    "swiglu_mlp_fp8_supported",
    "swiglu_mlp_fp8_tokenwise",
    "swiglu_quantize_reference",
]

SWIGLU_GROUP = 128  # features per activation scale of the down projection's input (the kernel's tile width)
# launch configurations at decode M (<= 64) per (I, K) of the gate/up kernel (its "group" also sets the
# down input's scale blocks, on every backend and M) and per (N, K) of the down GEMM; others take
# _default_configs. Filled from benchmarks/quant/bench_fused_mlp.py --tune (RESULTS.md).
SWIGLU_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (12288, 4096): {"group": 128, "block_m": 64, "block_k": 128, "num_warps": 8, "num_stages": 4},
}
DOWN_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (4096, 12288): {"block_m": 64, "block_n": 32, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 4},
}


def _default_configs(m: int, group: int) -> tuple[dict[str, int], dict[str, int]]:
    """Launch defaults by M: one 64-row tile at decode, 128-row tiles for prefill-sized M."""
    block_m = 64 if m <= 64 else 128
    return ({"block_m": block_m, "block_k": 128, "num_warps": 8, "num_stages": 4},
            {"block_m": block_m, "block_n": 64, "block_k": min(128, group), "split_k": 1,
             "num_warps": 4 if m <= 64 else 8, "num_stages": 4})


def swiglu_mlp_fp8_supported(
    gate_up: nn.Module, down: nn.Module, *, group: int | None = None, tokenwise: bool = False
) -> str | None:
    """None when :func:`swiglu_mlp_fp8` (``tokenwise``: :func:`swiglu_mlp_fp8_tokenwise`) can run these
    layers, else why not (for reports)."""
    for name, layer in (("gate_up", gate_up), ("down", down)):
        if getattr(layer, "scheme", None) != "fp8_row":
            return f"{name} scheme={getattr(layer, 'scheme', type(layer).__name__)!r}; the fused MLP needs 'fp8_row'"
        if layer.bias is not None and not tokenwise:
            return f"{name} has a bias"
    inter = gate_up.out_features // 2
    if gate_up.out_features % 2 or down.in_features != inter:
        return f"gate_up out_features={gate_up.out_features} is not 2 x down in_features={down.in_features}"
    if tokenwise:
        return None
    group = group or SWIGLU_CONFIGS.get((inter, gate_up.in_features), {}).get("group", SWIGLU_GROUP)
    if inter % group:
        return f"intermediate size {inter} is not a multiple of group={group}"
    if gate_up.fp8_dtype != down.fp8_dtype:
        return "gate_up and down use different FP8 dtypes"
    return None


def _silu_triton_ok(t: torch.Tensor) -> bool:
    if t.device.type != "cuda" or getattr(torch.version, "hip", None) is not None:
        return False
    from lumenrl_quant import triton_kernels as tk

    return tk.triton_available(t.device) and torch.cuda.get_device_capability(t.device) >= (8, 9)


def _silu_mul_quantize_torch(gate_up: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_fp8(torch.nn.functional.silu(gate) * up, dtype=dtype, granularity="rowwise", backend="torch")


def _silu_mul_quantize_impl(gate_up: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from lumenrl_quant.triton_swiglu import fp8_silu_mul_quantize

    return fp8_silu_mul_quantize(gate_up, dtype)


def _silu_mul_quantize_fake(gate_up: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    return gate_up.new_empty((m, inter), dtype=dtype), gate_up.new_empty((m, 1), dtype=torch.float32)


# the Triton kernel as an opaque op (inductor would otherwise trace into the launch); registered at
# import, once per process
_SILU_OP = getattr(getattr(torch.ops, "lumenrl_quant", None), "silu_mul_quantize", None)
if _SILU_OP is None:
    _SILU_OP = torch.library.custom_op("lumenrl_quant::silu_mul_quantize", mutates_args=())(_silu_mul_quantize_impl)
    _SILU_OP.register_fake(_silu_mul_quantize_fake)


def silu_mul_quantize(
    gate_up: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU activation straight to FP8: ``h = silu(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)``,
    in float32, quantized with one scale per token. ``gate_up`` (..., 2I) -> ``(codes (..., I), scales
    (..., 1))``, dequant scales (``h ≈ codes * scales``), the activations :meth:`QuantizedLinear.forward_quantized`
    of an ``fp8_row`` layer takes. ``backend``: ``auto`` (the Triton kernel on CUDA sm_89+, an opaque
    custom op under ``torch.compile``; else torch), ``triton`` or ``torch``."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}; allowed: auto, triton, torch")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up last dim {gate_up.shape[-1]} is odd; allowed: 2 x the intermediate size")
    lead, inter = gate_up.shape[:-1], gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * inter)
    if backend == "auto":
        backend = "triton" if _silu_triton_ok(g2) else "torch"
    if backend == "triton":
        op = _SILU_OP if torch.compiler.is_compiling() else _silu_mul_quantize_impl  # eager: no dispatch cost
        codes, scales = op(g2, dtype)
    else:
        codes, scales = _silu_mul_quantize_torch(g2, dtype)
    return codes.reshape(*lead, inter), scales.reshape(*lead, 1)


def swiglu_mlp_fp8_tokenwise(
    x: torch.Tensor, gate_up: nn.Module, down: nn.Module, *, backend: str = "auto",
    x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``gate, up = gate_up(x).chunk(2, -1)``, both ``fp8_row``
    :class:`~lumenrl_quant.QuantizedLinear`, the down input quantized per token by
    :func:`silu_mul_quantize` (one kernel between the two GEMMs; see the module doc). ``backend``
    applies to that kernel; the GEMMs take their layers' paths. ``x_quantized``: ``x`` already as
    per-token FP8 ``(codes, scales)`` (e.g. :func:`lumenrl_quant.rmsnorm_quantize_fp8`); ``x`` then
    gives only the output dtype."""
    reason = swiglu_mlp_fp8_supported(gate_up, down, tokenwise=True)
    if reason is not None:
        raise ValueError(f"swiglu_mlp_fp8_tokenwise: {reason}")
    gu = gate_up(x) if x_quantized is None else gate_up.forward_quantized(*x_quantized, x.dtype)
    codes, scales = silu_mul_quantize(gu, dtype=down.fp8_dtype, backend=backend)
    return down.forward_quantized(codes, scales, x.dtype)


def swiglu_quantize_reference(
    gate: torch.Tensor, up: torch.Tensor, *, group: int = SWIGLU_GROUP, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` in float32, quantized in 1 x ``group`` blocks: ``(codes (M, I), scales (M, I / group))``."""
    gate, up = gate.float(), up.float()
    h = gate * torch.sigmoid(gate) * up
    return quantize_fp8(h, dtype=dtype, granularity="block", block_size=(1, group), backend="torch")


def _triton_ok(x: torch.Tensor, k: int, inter: int, group: int) -> bool:
    if x.device.type != "cuda" or getattr(torch.version, "hip", None) is not None:
        return False
    from lumenrl_quant import triton_kernels as tk

    return (tk.triton_available(x.device) and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and k % 128 == 0 and inter % 128 == 0)


def swiglu_mlp_fp8(
    x: torch.Tensor,
    gate_up: nn.Module,
    down: nn.Module,
    *,
    group: int | None = None,
    backend: str = "auto",
    configs: tuple[Mapping[str, int] | None, Mapping[str, int] | None] | None = None,
) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``gate, up = gate_up(x).chunk(2, -1)``, both ``fp8_row``
    :class:`~lumenrl_quant.QuantizedLinear` (see module doc). ``x`` (..., K) in bf16/fp16/fp32;
    ``backend``: ``auto``, ``triton`` or ``torch``; ``configs``: launch configurations of the two
    kernels (benchmarks), else the tuned ones of this shape (Triton only: a non-empty entry is refused
    where the torch path runs, ``auto`` included); ``group``: features per scale of the down
    input, else the tuned one of this shape (``SWIGLU_CONFIGS``) or ``SWIGLU_GROUP``, on every backend."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}; allowed: auto, triton, torch")
    if configs is not None and (not isinstance(configs, (tuple, list)) or len(configs) != 2):
        raise ValueError(f"configs={configs!r}; allowed: None or (gate/up config, down config), each a dict or None")
    k, inter = x.shape[-1], down.in_features
    group = group or SWIGLU_CONFIGS.get((inter, k), {}).get("group", SWIGLU_GROUP)
    reason = swiglu_mlp_fp8_supported(gate_up, down, group=group)
    if reason is not None:
        raise ValueError(f"swiglu_mlp_fp8: {reason}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    asked = backend
    if backend == "auto":
        backend = "triton" if _triton_ok(x2, k, inter, group) else "torch"
    if backend == "torch" and configs is not None and any(configs):
        raise ValueError(f"configs={configs!r} sets the Triton kernels' launch, but backend={asked!r} runs the torch "
                         "path here; allowed: configs=None, or backend='triton' (CUDA sm_89+ with Triton, K and I "
                         "multiples of 128)")
    compiling = torch.compiler.is_compiling()
    a_q, a_scale = quantize_fp8(x2, dtype=gate_up.fp8_dtype, granularity="rowwise",
                                backend="torch" if compiling or backend == "torch" else "auto")
    if backend == "triton":
        from lumenrl_quant import triton_gemm as tg

        up_cfg, down_cfg = configs if configs is not None else (None, None)
        up_base, down_base = _default_configs(x2.shape[0], group)
        tuned = x2.shape[0] <= 64 and SWIGLU_CONFIGS.get((inter, k), {}).get("group", group) == group  # decode M
        up_cfg = {**up_base, **(SWIGLU_CONFIGS.get((inter, k), {}) if tuned else {}), **(up_cfg or {}), "group": group}
        down_cfg = {**down_base, **(DOWN_CONFIGS.get((down.out_features, inter), {}) if tuned else {}),
                    **(down_cfg or {})}
        h_q, h_scale = tg.fp8_swiglu_quant(a_q, a_scale, gate_up.weight, gate_up.weight_scale,
                                           out_dtype=down.fp8_dtype, config=up_cfg)
        out = tg.fp8_group_act_gemm(h_q, h_scale, down.weight, down.weight_scale, group=group, out_dtype=x.dtype,
                                    config=down_cfg)
    else:
        from lumenrl_quant.gemm import emulated_scaled_mm

        gu = emulated_scaled_mm(a_q, a_scale, gate_up.weight, gate_up.weight_scale, out_dtype=torch.float32)
        h_q, h_scale = swiglu_quantize_reference(gu[:, :inter], gu[:, inter:], group=group, dtype=down.fp8_dtype)
        out = emulated_scaled_mm(h_q, h_scale, down.weight, down.weight_scale, out_dtype=x.dtype,
                                 a_block_size=(1, group))
    return out.reshape(*lead, down.out_features)
