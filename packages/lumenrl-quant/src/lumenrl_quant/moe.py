"""Fused mixture-of-experts layer for decode: align by expert, two Triton grouped GEMMs, sum over k.

Computes what transformers' experts modules (``Qwen3MoeExperts`` and the other ``@use_experts_implementation``
classes with the default layout) compute::

    out[t] = sum_j  w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = topk_ids[t, j]

with ``w_gate_up`` (E, 2I, H) = ``cat([gate, up], dim=1)`` per expert and ``w_down`` (E, H, I).

Method
------
1. Align: the N*k (token, slot) pairs sorted by expert into blocks of ``block_m`` rows, each expert's
   run padded to a whole number of blocks with the sentinel pair id N*k; all shapes static (the pair list
   is sized for the worst case N*k + min(N*k, E) * (block_m - 1)), no host sync, so the whole layer is
   capturable in a CUDA graph. :func:`moe_align` is the torch version (stable sort: the reference); the
   Triton path runs :func:`~lumenrl_quant.triton_moe.moe_align_triton` (a memset and three small
   kernels instead of ~25 torch ops per layer: count, runs and block experts, atomic placement).
2. Gate/up grouped GEMM (:mod:`lumenrl_quant.triton_moe`) with ``silu(gate) * up`` in its epilogue:
   ``inter`` (N*k, I) in the activation dtype.
3. Down grouped GEMM times the pair's routing weight: ``per_pair`` (N*k, H) in the activation dtype.
4. ``per_pair.view(N, k, H).sum(1)``, accumulated in float32 and rounded once: deterministic (no
   atomics; a pair's row in its block does not change its result), the order HF's ``grouped_mm`` sums in.

Numerics: float32 accumulation; ``silu(gate) * up`` in float32 from the accumulators, rounded once to the
activation dtype (HF rounds gate/up, then the product); each pair's weighted output rounded once (HF:
twice). FP8 expert weights: float8 codes with 128 x 128 block dequant scales, lumenrl-quant's blockwise
layout (:func:`quantize_experts_fp8`: ``scale`` (E, ⌈rows/128⌉, ⌈cols/128⌉), ``w ≈ q * scale``), in one
of two modes:

* w8a16 (default): activations stay 16-bit; the kernel widens each weight tile exactly and scales the
  tile's product per output column, so the result equals the 16-bit product with the dequantized weight
  up to float32 summation order;
* w8a8 (``fp8_activations=True``: the ``fp8_block`` scheme, "W8A8, 1x128 activation groups"): each GEMM's
  input is quantized per token in 1 x 128 groups (:func:`~lumenrl_quant.quantize_fp8`, the hidden
  states before gate/up, ``silu(gate) * up`` (rounded to the activation dtype) before down) and the
  dots run on FP8 codes, scaled by the row's group scale times the column's block scale. Approximate
  by the activation rounding (as every W8A8 linear of the scheme); :func:`fused_moe_reference` with
  the same flag quantizes the same way.

Exact: the routing (given), the sort; approximate: float32 summation order.

Launch configuration: :class:`FusedMoEConfig` (``block_m`` shared by both GEMMs, a :class:`MoETile` each),
picked by :func:`fused_moe_config` from the mean pairs per expert N*k/E (decode sees ~4 on
Qwen3-30B-A3B at batch 64). ``benchmarks/moe/decode_speed.py`` (``moe_kernel_sweep``) times others.

Backends: ``triton`` (CUDA; also CPU tensors when Triton's interpreter is on, as the tests run it) and
``torch`` (:func:`fused_moe_reference` in float32: CPU, one host sync per call, not capturable).
Under ``torch.compile`` the Triton path is one opaque custom op (``lumenrl_quant::fused_moe``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lumenrl_quant.fp8 import dequantize_fp8, quantize_fp8

__all__ = [
    "EXPERT_BLOCK",
    "FusedMoEConfig",
    "MoETile",
    "dequantize_experts_fp8",
    "fused_moe",
    "fused_moe_config",
    "fused_moe_reference",
    "moe_align",
    "quantize_experts_fp8",
    "triton_moe_available",
]

EXPERT_BLOCK = (128, 128)  # FP8 expert weight scale blocks (rows, cols)
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoETile:
    """Launch parameters of one grouped GEMM (powers of two; ``block_n``: features per half for gate/up)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedMoEConfig:
    """Launch configuration: ``block_m`` pairs per expert block (both GEMMs: the sort pads to it),
    ``gate_up`` and ``down`` tiles (``block_k`` must divide 128 with FP8 weights)."""

    block_m: int = 16
    gate_up: MoETile = field(default_factory=MoETile)
    down: MoETile = field(default_factory=lambda: MoETile(block_n=128))

    def check(self, *, fp8: bool, fp8_activations: bool = False) -> None:
        """Raise ValueError naming the first bad field."""
        _pow2("block_m", self.block_m, 16)
        for name, tile in (("gate_up", self.gate_up), ("down", self.down)):
            _pow2(f"{name}.block_n", tile.block_n, 16)
            _pow2(f"{name}.block_k", tile.block_k, 16)
            _pow2(f"{name}.num_warps", tile.num_warps, 1)
            if tile.num_stages < 1:
                raise ValueError(f"{name}.num_stages={tile.num_stages}; allowed: an int >= 1")
            if fp8 and EXPERT_BLOCK[1] % tile.block_k:
                raise ValueError(f"{name}.block_k={tile.block_k} with FP8 weights; allowed: a divisor of "
                                 f"{EXPERT_BLOCK[1]} (one scale block per K tile)")
            if fp8_activations and tile.block_k < 32:
                raise ValueError(f"{name}.block_k={tile.block_k} with FP8 activations; allowed: 32, 64 or 128 "
                                 "(the FP8 dot's smallest K)")


def _pow2(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low or value & (value - 1):
        raise ValueError(f"{name}={value!r}; allowed: a power of two >= {low}")


# launch configurations by the mean pairs per expert (N*k/E): (upper bound, config). Starting points from the
# shape of vLLM's published H200 tables for this layer width (E 128, I 768), translated to this kernel (a
# gate/up tile holds block_n features of *both* halves); TUNED_CONFIGS overrides them per shape.
def _tiles(m: int, up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> FusedMoEConfig:
    def tile(t: tuple[int, int, int, int]) -> MoETile:
        return MoETile(block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3])

    return FusedMoEConfig(block_m=m, gate_up=tile(up), down=tile(down))


DEFAULT_CONFIGS: tuple[tuple[float, FusedMoEConfig], ...] = (
    (0.25, _tiles(16, (32, 64, 4, 4), (64, 64, 4, 4))),  # a few tokens: few experts hit, small tiles for programs
    (2.0, _tiles(16, (32, 128, 4, 3), (64, 128, 4, 3))),
    (16.0, _tiles(16, (64, 128, 4, 3), (128, 128, 4, 3))),  # decode batches (Qwen3-30B-A3B b64: 4 per expert)
    (64.0, _tiles(32, (64, 128, 4, 3), (128, 128, 4, 3))),
    (float("inf"), _tiles(64, (64, 64, 4, 4), (128, 64, 4, 4))),  # prefill
)
# tuned per (E, H, I, weights mode, the DEFAULT_CONFIGS bound of N*k/E), mode one of "16bit", "w8a16", "w8a8";
# the sweep in benchmarks/moe/fused_moe_kernel.py (--sweep) prints the entry of its best configuration
TUNED_CONFIGS: dict[tuple[int, int, int, str, float], FusedMoEConfig] = {
    # H200, Qwen3-30B-A3B experts, decode batch 64 (python -m benchmarks.moe.fused_moe_kernel --sweep --fp8):
    # whole layer 229 us vs 236 us with the class default. The bf16 sweep kept the default (302 us).
    (128, 2048, 768, "w8a16", 16.0): _tiles(16, (32, 128, 4, 3), (64, 128, 4, 3)),
}


def weights_mode(fp8: bool, fp8_activations: bool = False) -> str:
    """The TUNED_CONFIGS mode: ``16bit``, ``w8a16`` or ``w8a8``."""
    return "w8a8" if fp8 and fp8_activations else "w8a16" if fp8 else "16bit"


def load_class(num_pairs: int, num_experts: int) -> float:
    """The DEFAULT_CONFIGS bound that ``num_pairs / num_experts`` falls under."""
    mean = num_pairs / max(num_experts, 1)
    return next(bound for bound, _ in DEFAULT_CONFIGS if mean <= bound)


def fused_moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int = 0, inter: int = 0, *,
                     fp8: bool = False, fp8_activations: bool = False) -> FusedMoEConfig:
    """The launch configuration for N tokens routed top-k over E experts: the tuned one of this (E, H, I,
    weights mode, load class) when known, else the class's default (16-row blocks up to 16 pairs per
    expert: one block per expert at decode; 32 and 64-row blocks for prefill)."""
    bound = load_class(num_tokens * top_k, num_experts)
    tuned = TUNED_CONFIGS.get((num_experts, hidden, inter, weights_mode(fp8, fp8_activations), bound))
    return tuned if tuned is not None else dict(DEFAULT_CONFIGS)[bound]


def num_align_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of the worst-case padded pair list: ``N*k + min(N*k, E) * (block_m - 1)`` rows, rounded up."""
    return -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs of ``topk_ids`` (N, k) by expert into ``block_m``-row blocks.

    Returns ``pairs`` (P,) int32: pair ids ``t * k + j`` grouped by expert, each expert's run padded to a
    multiple of ``block_m`` with the sentinel N*k; and ``block_experts`` (P / block_m,) int32: the expert
    of each block, ``num_experts`` for the unused blocks at the end. P = the worst case
    ``N*k + min(N*k, E) * (block_m - 1)`` rounded up to ``block_m``: static, so no host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # (S,)
    s = flat.numel()
    blocks = num_align_blocks(s, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # (E,) end of each expert's padded run
    order = torch.argsort(flat, stable=True)  # (S,) pair ids by expert
    sorted_experts = flat[order]
    rank = torch.arange(s, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]  # place in its run
    pairs = torch.full((blocks * block_m,), s, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, (ends - padded)[sorted_experts] + rank, order.to(torch.int32))
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # E past the last run
    return pairs, block_experts


def quantize_experts_fp8(
    w: torch.Tensor, *, dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights (E, rows, cols) -> float8 codes (E, rows, cols) and dequant scales (E, ⌈rows/128⌉,
    ⌈cols/128⌉) in 128 x 128 blocks (:func:`~lumenrl_quant.quantize_fp8`, one expert at a time: the
    float32 working copy is one expert's). ``dtype``: the codes' FP8 dtype (default ``float8_e4m3fn``, or
    ``out``'s codes dtype). ``out``: write into these (codes, scales) in place; their shapes must be
    those this call returns, and a ``dtype`` other than the codes' is refused."""
    if w.dim() != 3:
        raise ValueError(f"expert weights need shape (E, rows, cols); got {tuple(w.shape)}")
    e, rows, cols = w.shape
    scale_shape = (e, -(-rows // EXPERT_BLOCK[0]), -(-cols // EXPERT_BLOCK[1]))
    if out is None:
        dtype = torch.float8_e4m3fn if dtype is None else dtype
        out = (torch.empty(w.shape, dtype=dtype, device=w.device),
               torch.empty(scale_shape, dtype=torch.float32, device=w.device))
    codes, scales = out
    if dtype is not None and codes.dtype != dtype:
        raise ValueError(f"dtype={dtype} differs from out's codes dtype {codes.dtype}; allowed: dtype=None or "
                         f"dtype={codes.dtype} with this out")
    if tuple(codes.shape) != tuple(w.shape) or tuple(scales.shape) != scale_shape:
        raise ValueError(f"out shapes (codes {tuple(codes.shape)}, scales {tuple(scales.shape)}) do not fit w "
                         f"{tuple(w.shape)}; allowed: codes {tuple(w.shape)}, scales {scale_shape}")
    for i in range(e):
        q, s = quantize_fp8(w[i], dtype=codes.dtype, granularity="block", block_size=EXPERT_BLOCK)
        codes[i].copy_(q)
        scales[i].copy_(s)
    return codes, scales


def dequantize_experts_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_experts_fp8`: (E, rows, cols) in ``dtype``."""
    return dequantize_fp8(q, scale, block_size=EXPERT_BLOCK, dtype=dtype)


def _fp8_rows(x: torch.Tensor, dtype: torch.dtype, fp8_activations: bool) -> torch.Tensor:
    """``x`` rounded as the w8a8 kernel sees it (1 x 128 group codes times scales), or ``x`` itself."""
    if not fp8_activations:
        return x
    q, s = quantize_fp8(x, dtype=dtype, granularity="block", block_size=(1, EXPERT_BLOCK[1]), backend="torch")
    return dequantize_fp8(q, s, block_size=(1, EXPERT_BLOCK[1]), dtype=x.dtype)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e].to(dtype)
    return dequantize_fp8(w[e], scale[e], block_size=EXPERT_BLOCK, dtype=dtype)


def fused_moe_reference(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, *, activation: str = "silu", w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None, fp8_activations: bool = False, inter_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The HF experts formula, one expert at a time, in ``hidden``'s dtype (pass float64 inputs for a
    float64 reference); FP8 weights are dequantized with their scales. Same arguments as :func:`fused_moe`;
    with ``fp8_activations`` both GEMM inputs are rounded to 1 x 128 FP8 groups first, the down input
    after rounding ``silu(gate) * up`` to ``inter_dtype`` (the kernel's activation dtype; default
    ``hidden``'s)."""
    _check_activation(activation)
    dtype, inter = hidden.dtype, w_down.shape[-1]
    fp8 = w_gate_up.dtype if w_gate_up.dtype in _FP8 else torch.float8_e4m3fn
    out = torch.zeros_like(hidden)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        x = _fp8_rows(hidden[token], fp8, fp8_activations)
        gate, up = F.linear(x, _expert_weight(w_gate_up, w_gate_up_scale, e, dtype)).split(inter, -1)
        act = F.silu(gate) * up
        if fp8_activations:
            act = _fp8_rows(act.to(inter_dtype or dtype), fp8, True).to(dtype)
        y = F.linear(act, _expert_weight(w_down, w_down_scale, e, dtype))
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(dtype))
    return out


def _check_activation(activation: str) -> None:
    if activation != "silu":
        raise ValueError(f"activation={activation!r}; allowed: 'silu' (SwiGLU experts)")


def _check(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale) -> bool:
    """Shapes and dtypes (see :func:`fused_moe`); returns whether the weights are FP8."""
    n, h = hidden.shape
    e, two_i, hw = w_gate_up.shape
    if hw != h or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"need hidden (N, H), w_gate_up (E, 2I, H), w_down (E, H, I); got {tuple(hidden.shape)}, "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"need topk_ids and topk_weights (N, k) with N={n}; got {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.is_floating_point():
        raise ValueError(f"topk_ids dtype={topk_ids.dtype}; allowed: an integer dtype")
    fp8 = w_gate_up.dtype in _FP8
    if fp8 != (w_down.dtype in _FP8) or fp8 != (w_gate_up_scale is not None) or fp8 != (w_down_scale is not None):
        raise ValueError("FP8 expert weights need both weights in FP8 with both scales; 16/32-bit weights take none "
                         f"(got {w_gate_up.dtype}, {w_down.dtype}, scales given: {w_gate_up_scale is not None}, "
                         f"{w_down_scale is not None})")
    if not fp8 and (w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype):
        raise ValueError(f"weights {w_gate_up.dtype}/{w_down.dtype} and hidden {hidden.dtype} differ; allowed: one "
                         "dtype, or FP8 weights with scales")
    for name, w, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        want = (e, -(-w.shape[1] // EXPERT_BLOCK[0]), -(-w.shape[2] // EXPERT_BLOCK[1]))
        if fp8 and tuple(scale.shape) != want:
            raise ValueError(f"{name}_scale shape {tuple(scale.shape)}; allowed: {want} (128 x 128 blocks)")
    return fp8


def triton_moe_available(device: torch.device | str) -> bool:
    """True when the Triton kernels run on ``device``: CUDA with Triton, or CPU under Triton's interpreter."""
    from lumenrl_quant import triton_moe

    if triton_moe.triton is None:
        return False
    kind = torch.device(device).type
    return (kind == "cuda" and torch.cuda.is_available()) or (kind == "cpu" and triton_moe.interpreted())


def _config_list(config: FusedMoEConfig | None) -> list[int]:
    if config is None:
        return []
    return [config.block_m, *(getattr(t, f) for t in (config.gate_up, config.down)
                              for f in ("block_n", "block_k", "num_warps", "num_stages"))]


def _config_from_list(values: list[int]) -> FusedMoEConfig:
    m, *rest = values
    return FusedMoEConfig(block_m=m, gate_up=MoETile(block_n=rest[0], block_k=rest[1], num_warps=rest[2],
                                                     num_stages=rest[3]),
                          down=MoETile(block_n=rest[4], block_k=rest[5], num_warps=rest[6], num_stages=rest[7]))


def _group_codes(x: torch.Tensor, dtype: torch.dtype, a8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w8a8: ``x`` (rows, K) as 1 x 128 FP8 group codes and scales (rows, ⌈K/128⌉); else ``(x, None)``."""
    if not a8:
        return x, None
    return quantize_fp8(x, dtype=dtype, granularity="block", block_size=(1, EXPERT_BLOCK[1]))


def _fused_moe_triton(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale,
                      config: list[int], fp8_activations: bool = False) -> torch.Tensor:
    from lumenrl_quant.triton_moe import moe_align_triton, moe_grouped_gemm

    (n, h), (e, two_i, _), k = hidden.shape, w_gate_up.shape, topk_ids.shape[1]
    fp8 = w_gate_up_scale is not None
    cfg = _config_from_list(config) if config else fused_moe_config(n, k, e, h, two_i // 2, fp8=fp8,
                                                                    fp8_activations=fp8_activations)
    pairs, block_experts = moe_align_triton(topk_ids, e, cfg.block_m, num_align_blocks(n * k, e, cfg.block_m))
    hidden = hidden.contiguous()
    inter = hidden.new_empty((n * k, two_i // 2))  # (S, I)
    a, a_scale = _group_codes(hidden, w_gate_up.dtype, fp8_activations)  # (N, H) [+ (N, H/128)]
    moe_grouped_gemm(a, w_gate_up, w_gate_up_scale, inter, pairs, block_experts, None, gated=True,
                     a_row_div=k, block_m=cfg.block_m, tile=cfg.gate_up, scale_block=EXPERT_BLOCK[0], a_scale=a_scale)
    per_pair = hidden.new_empty((n * k, h))  # (S, H)
    a, a_scale = _group_codes(inter, w_down.dtype, fp8_activations)  # (S, I) [+ (S, I/128)]
    moe_grouped_gemm(a, w_down, w_down_scale, per_pair, pairs, block_experts, topk_weights.reshape(-1).contiguous(),
                     gated=False, a_row_div=1, block_m=cfg.block_m, tile=cfg.down, scale_block=EXPERT_BLOCK[0],
                     a_scale=a_scale)
    return per_pair.view(n, k, h).sum(dim=1)  # float32 accumulation, one rounding (torch's reduction)


def _fused_moe_fake(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale, config,
                    fp8_activations=False):
    return torch.empty_like(hidden)


# the Triton path as one opaque op under torch.compile; registered once per process
_OP = getattr(getattr(torch.ops, "lumenrl_quant", None), "fused_moe", None)
if _OP is None:
    _OP = torch.library.custom_op(
        "lumenrl_quant::fused_moe", mutates_args=(),
        schema="(Tensor hidden, Tensor w_gate_up, Tensor w_down, Tensor topk_ids, Tensor topk_weights, "
               "Tensor? w_gate_up_scale, Tensor? w_down_scale, int[] config, bool fp8_activations=False) -> Tensor",
    )(_fused_moe_triton)
    _OP.register_fake(_fused_moe_fake)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "silu",
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    config: FusedMoEConfig | None = None,
    backend: str = "auto",
    fp8_activations: bool = False,
) -> torch.Tensor:
    """The MoE experts layer (see module doc): ``hidden`` (N, H), ``w_gate_up`` (E, 2I, H), ``w_down``
    (E, H, I), ``topk_ids`` / ``topk_weights`` (N, k) -> (N, H) in ``hidden``'s dtype. FP8 weights
    (float8 codes) need ``w_gate_up_scale`` / ``w_down_scale`` from :func:`quantize_experts_fp8`.
    ``config``: launch configuration of the Triton kernels (default :func:`fused_moe_config`; refused where
    the torch path runs, ``auto`` included); ``backend``: ``auto`` (Triton
    where :func:`triton_moe_available`, else torch), ``triton`` or ``torch``. ``fp8_activations``: with
    FP8 weights, W8A8 (both GEMM inputs in 1 x 128 FP8 groups, FP8 dots; module doc)."""
    _check_activation(activation)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}; allowed: auto, triton, torch")
    fp8 = _check(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale)
    if fp8_activations and not fp8:
        raise ValueError("fp8_activations=True needs FP8 expert weights with scales (W8A8); allowed with 16/32-bit "
                         "weights: fp8_activations=False")
    if config is not None:
        config.check(fp8=fp8, fp8_activations=fp8_activations)
    asked = backend
    if backend == "auto":
        backend = "triton" if triton_moe_available(hidden.device) else "torch"
    if backend == "torch" and config is not None:
        raise ValueError(f"config={config!r} sets the Triton kernels' launch, but backend={asked!r} runs the torch "
                         "path here; allowed: config=None, or backend='triton' (where triton_moe_available)")
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    if backend == "torch":
        out = fused_moe_reference(hidden.float(), w_gate_up if fp8 else w_gate_up.float(),
                                  w_down if fp8 else w_down.float(), topk_ids, topk_weights.float(),
                                  w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale,
                                  fp8_activations=fp8_activations, inter_dtype=hidden.dtype)
        return out.to(hidden.dtype)
    op = _OP if torch.compiler.is_compiling() else _fused_moe_triton
    return op(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale, _config_list(config),
              fp8_activations)
