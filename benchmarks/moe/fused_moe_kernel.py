"""One MoE experts layer at decode: lumenrl-quant's ``fused_moe`` against HF's ``grouped_mm`` path, and a launch sweep.

Shape: Qwen3-30B-A3B's layer (E 128 experts, top-8, hidden 2048, expert width 768), N = 64 tokens (the
decode batch), bf16 activations, random weights and a softmax-top-k routing of random logits (nearly every
expert is hit, ~4 pairs each). Each variant is captured in one CUDA graph and replayed (as in a decode
step; :func:`benchmarks.quant._common.time_graph_ms`, median of 20 replays).

* :func:`moe_kernel_bench`: ``grouped_mm`` (transformers' ``grouped_mm_experts_forward`` on a
  ``Qwen3MoeExperts`` module with the same weights), ``fused_bf16`` and ``fused_fp8`` (128 x 128 block FP8
  weights, w8a16) at their default configurations. Achieved bandwidth = bytes of the experts the routing
  hits (their gate/up and down weights, plus FP8 scales) over the time; the error of each against a
  float64 reference.
* :func:`moe_kernel_sweep`: each grouped GEMM alone (the sort done once) over block_n x block_k x
  num_warps x num_stages at the load class's block_m (16 at N = 64), then the whole layer with the two best tiles; prints a table and
  the ``TUNED_CONFIGS`` entry of the best (``lumenrl_quant.moe``). About 70 Triton compiles.

    python -m benchmarks.moe.fused_moe_kernel            # bench: grouped_mm vs fused bf16 / fp8, GB/s
    python -m benchmarks.moe.fused_moe_kernel --sweep    # tune the bf16 tiles (--fp8: the FP8 ones)

``--smoke``: tiny shapes on the CPU (the bench: lumenrl-quant's torch path; the sweep needs Triton's
interpreter, ``TRITON_INTERPRET=1``), to check the script runs.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from benchmarks.quant._common import time_graph_ms

from lumenrl_quant import (
    FusedMoEConfig,
    MoETile,
    fused_moe,
    fused_moe_config,
    fused_moe_reference,
    moe_align,
    quantize_experts_fp8,
    quantize_fp8,
)
from lumenrl_quant.moe import load_class, weights_mode

__all__ = ["moe_kernel_bench", "moe_kernel_sweep"]

FULL = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
SMOKE = {"experts": 8, "top_k": 2, "hidden": 64, "inter": 32}


def _layer(shape: dict[str, int], n: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Random bf16 (fp32 on the CPU) layer weights, FP8 copies, inputs and routing."""
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randn(e, 2 * i, h, generator=gen, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) * 0.02).to(dtype)
    x = torch.randn(n, h, generator=gen, device=device).to(dtype)
    weights, ids = torch.randn(n, e, generator=gen, device=device).softmax(-1).topk(k, dim=-1)
    (q1, s1), (q2, s2) = quantize_experts_fp8(w1), quantize_experts_fp8(w2)
    return {"x": x, "w1": w1, "w2": w2, "ids": ids, "tw": (weights / weights.sum(-1, keepdim=True)).to(dtype),
            "q1": q1, "s1": s1, "q2": q2, "s2": s2}


def _hit_bytes(layer: dict[str, Any], fp8: bool) -> int:
    """Bytes of the experts the routing reads: gate/up + down weights (and FP8 scales) of each hit expert."""
    hit = int(layer["ids"].unique().numel())
    if fp8:
        per = sum(t[0].numel() * t.element_size() for t in (layer["q1"], layer["q2"], layer["s1"], layer["s2"]))
    else:
        per = sum(t[0].numel() * t.element_size() for t in (layer["w1"], layer["w2"]))
    return hit * per


def _hf_experts(layer: dict[str, Any]) -> Any:
    """transformers' grouped_mm experts forward over the layer's bf16 weights."""
    from transformers import AutoConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = layer["w1"].shape
    config = AutoConfig.for_model("qwen3_moe", hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e,
                                  hidden_act="silu")
    module = Qwen3MoeExperts(config).to(device=layer["w1"].device, dtype=layer["w1"].dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(layer["w1"])
        module.down_proj.copy_(layer["w2"])
    return lambda: grouped_mm_experts_forward(module, layer["x"], layer["ids"], layer["tw"])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@torch.no_grad()
def moe_kernel_bench(smoke: bool = False, n: int = 64) -> dict[str, Any]:
    """grouped_mm vs fused bf16 vs fused FP8 on one layer (see module doc): microseconds, GB/s, error."""
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    layer = _layer(SMOKE if device == "cpu" else FULL, n, device)
    x, ids, tw = layer["x"], layer["ids"], layer["tw"]
    fp8 = {"w_gate_up_scale": layer["s1"], "w_down_scale": layer["s2"]}
    variants = {
        "grouped_mm": (_hf_experts(layer), False),
        "fused_bf16": (lambda: fused_moe(x, layer["w1"], layer["w2"], ids, tw), False),
        "fused_fp8": (lambda: fused_moe(x, layer["q1"], layer["q2"], ids, tw, **fp8), True),
        "fused_w8a8": (lambda: fused_moe(x, layer["q1"], layer["q2"], ids, tw, fp8_activations=True, **fp8), True),
    }
    ref = fused_moe_reference(x.double(), layer["w1"].double(), layer["w2"].double(), ids, tw.double())
    ref8 = fused_moe_reference(x.double(), layer["q1"], layer["q2"], ids, tw.double(), **fp8)
    ref8a8 = fused_moe_reference(x.double(), layer["q1"], layer["q2"], ids, tw.double(), fp8_activations=True,
                                 inter_dtype=x.dtype, **fp8)
    out: dict[str, Any] = {"device": device, "tokens": n, **(SMOKE if device == "cpu" else FULL),
                           "experts_hit": int(ids.unique().numel())}
    for name, (fn, is_fp8) in variants.items():
        ms, how = time_graph_ms([fn])
        out[f"{name}_us"] = ms * 1e3
        out[f"{name}_gbs"] = _hit_bytes(layer, is_fp8) / (ms * 1e-3) / 1e9
        out[f"{name}_rel_err"] = _rel_err(fn(), ref8a8 if name == "fused_w8a8" else ref8 if is_fp8 else ref)
        out["timing"] = how
    out["fused_bf16_vs_grouped_mm"] = out["grouped_mm_us"] / out["fused_bf16_us"]
    out["fused_fp8_vs_fused_bf16"] = out["fused_bf16_us"] / out["fused_fp8_us"]
    out["fused_w8a8_vs_fused_bf16"] = out["fused_bf16_us"] / out["fused_w8a8_us"]
    return out


def _tiles(fp8: bool, smoke: bool) -> list[MoETile]:
    if smoke:
        return [MoETile(block_n=16, block_k=32, num_warps=4, num_stages=2), MoETile(block_n=32, block_k=64)]
    ks = (64, 128) if fp8 else (64, 128, 256)
    return [MoETile(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            for bn, bk, w, s in itertools.product((32, 64, 128), ks, (4, 8), (3, 4))]


def _time_gemm(layer: dict[str, Any], which: str, tile: MoETile, fp8: bool, block_m: int, a8: bool = False) -> float:
    """Microseconds of one grouped GEMM alone (``gate_up`` or ``down``) with ``tile``."""
    from lumenrl_quant.triton_moe import moe_grouped_gemm

    x, ids = layer["x"], layer["ids"]
    (n, k), inter = ids.shape, layer["w2"].shape[2]
    pairs, blocks = moe_align(ids, layer["w1"].shape[0], block_m)
    if which == "gate_up":
        a, w, scale, route = x, layer["q1" if fp8 else "w1"], layer["s1"] if fp8 else None, None
        out, kind = x.new_empty((n * k, inter)), {"gated": True, "a_row_div": k}
    else:
        a = torch.randn(n * k, inter, device=x.device).to(x.dtype)
        w, scale, route = layer["q2" if fp8 else "w2"], layer["s2"] if fp8 else None, layer["tw"].reshape(-1).contiguous()
        out, kind = x.new_empty((n * k, x.shape[1])), {"gated": False, "a_row_div": 1}
    a_scale = None
    if a8:
        a, a_scale = quantize_fp8(a, dtype=w.dtype, granularity="block", block_size=(1, 128))
    ms, _ = time_graph_ms([lambda: moe_grouped_gemm(a, w, scale, out, pairs, blocks, route, block_m=block_m,
                                                     tile=tile, a_scale=a_scale, **kind)])
    return ms * 1e3


@torch.no_grad()
def moe_kernel_sweep(n: int = 64, fp8: bool = False, smoke: bool = False, a8: bool = False) -> dict[str, Any]:
    """Time each grouped GEMM over its launch grid, then the whole layer with the best two; prints a table
    and the ``TUNED_CONFIGS`` line of the best (see module doc). Returns the best configuration's numbers."""
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    shape = SMOKE if device == "cpu" else FULL
    layer = _layer(shape, n, device)
    fp8 = fp8 or a8
    block_m = fused_moe_config(n, shape["top_k"], shape["experts"], fp8=fp8, fp8_activations=a8).block_m
    best: dict[str, tuple[float, MoETile]] = {}
    rows = []
    for which in ("gate_up", "down"):
        w = layer["q1" if fp8 else "w1"] if which == "gate_up" else layer["q2" if fp8 else "w2"]
        hit_bytes = int(layer["ids"].unique().numel()) * w[0].numel() * w.element_size()
        for tile in _tiles(fp8, smoke):
            try:
                us = _time_gemm(layer, which, tile, fp8, block_m, a8)
            except Exception as err:  # noqa: BLE001 - a tile that does not fit (shared memory): listed, skipped
                rows.append((which, tile, float("nan"), f"failed: {type(err).__name__}"))
                continue
            rows.append((which, tile, us, f"{hit_bytes / (us * 1e-6) / 1e9:7.0f} GB/s"))
            if which not in best or us < best[which][0]:
                best[which] = (us, tile)
    rows.sort(key=lambda r: (r[0], r[2] if r[2] == r[2] else float("inf")))
    print(f"{'gemm':8s} {'block_n':>7s} {'block_k':>7s} {'warps':>5s} {'stages':>6s} {'us':>9s}  bandwidth")
    for which, t, us, note in rows:
        print(f"{which:8s} {t.block_n:7d} {t.block_k:7d} {t.num_warps:5d} {t.num_stages:6d} {us:9.1f}  {note}")
    cfg = FusedMoEConfig(block_m=block_m, gate_up=best["gate_up"][1], down=best["down"][1])
    x, ids, tw = layer["x"], layer["ids"], layer["tw"]
    w1, w2 = (layer["q1"], layer["q2"]) if fp8 else (layer["w1"], layer["w2"])
    scales = {"w_gate_up_scale": layer["s1"], "w_down_scale": layer["s2"]} if fp8 else {}
    default = fused_moe_config(n, ids.shape[1], w1.shape[0], w1.shape[2], w2.shape[2], fp8=fp8, fp8_activations=a8)
    layer_us = {name: time_graph_ms([lambda c=c: fused_moe(x, w1, w2, ids, tw, config=c, fp8_activations=a8,
                                                           **scales)])[0] * 1e3
                for name, c in (("best", cfg), ("default", default))}
    e, h, i = w1.shape[0], w1.shape[2], w2.shape[2]
    print(f"whole layer: best {layer_us['best']:.1f} us, default {layer_us['default']:.1f} us")
    print(f"TUNED_CONFIGS[({e}, {h}, {i}, {weights_mode(fp8, a8)!r}, {load_class(n * ids.shape[1], e)})] = {cfg!r}")
    return {"tokens": n, "fp8": fp8, "best_layer_us": layer_us["best"], "default_layer_us": layer_us["default"],
            "gate_up_us": best["gate_up"][0], "down_us": best["down"][0], "config": repr(cfg)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="tune the launch tiles instead of the comparison")
    ap.add_argument("--fp8", action="store_true", help="--sweep: the FP8-weight kernels (w8a16)")
    ap.add_argument("--a8", action="store_true", help="--sweep: the W8A8 kernels (FP8 weights and activations)")
    ap.add_argument("--n", type=int, default=64, help="tokens (decode batch)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes")
    args = ap.parse_args()
    if args.sweep:
        moe_kernel_sweep(args.n, fp8=args.fp8, smoke=args.smoke, a8=args.a8)
        return
    for key, value in moe_kernel_bench(args.smoke, args.n).items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
