"""The fused FP8 SwiGLU MLP (lumenrl_quant.fused_mlp) against the unfused FP8 MLP and bf16, at decode.

One MLP of the fused-projection engine, M = batch rows: gate/up (2I x K) and down (K x I) as
``fp8_row`` ``QuantizedLinear`` layers, Qwen3-8B (K 4096, I 12288) and Qwen3-1.7B (K 2048, I 6144).
Weights are cycled over enough copies that the working set is several times the L2, and a whole
rotation is timed inside one CUDA graph (as in a decode step). Variants:

* ``bf16``: ``torch.compile`` of ``down(silu(gate) * up)`` on bf16 weights (fused gate/up weight);
* ``fp8_unfused``: the same under ``torch.compile`` with the two ``QuantizedLinear`` layers (the
  engine's path before: per-token quantization of the down input as inductor kernels between the GEMMs);
* ``fp8_fused``: ``torch.compile`` of :func:`lumenrl_quant.fused_mlp.swiglu_mlp_fp8` (x's per-token
  quantization fused into inductor's kernel, then the two Triton kernels), with the tuned or given
  launch configurations;
* ``fp8_token``: ``torch.compile`` of :func:`lumenrl_quant.fused_mlp.swiglu_mlp_fp8_tokenwise` (the engine's
  default since session 6): the per-token GEMMs of ``fp8_unfused`` with SiLU * up and the down input's
  quantization as one Triton kernel between them;
* ``silu_inductor`` / ``silu_kernel``: that step alone on a ``(M, 2I)`` bf16 gate/up output, as inductor
  compiles the torch ops (the ``fp8_unfused`` path) and as the Triton kernel over a sweep of its launch
  parameters (``block``, ``num_warps``, ``split``: programs per row);
* ``--tune``: the two kernels alone over a sweep of launch configurations (x pre-quantized); the best
  pair is written as ``best`` (``bench_fp8_rollout.py --mlp-config`` takes the JSON) and timed as
  ``fp8_fused``.

Every variant's output is compared with a float64 MLP on the same (dequantized where FP8) weights'
originals: ``sqnr_db``.

    python benchmarks/quant/bench_fused_mlp.py --tune --out fused_mlp_tune.json

Smoke (``run(True)``): the ``tiny`` MLP (K 128, I 128), M = 4, 2 weight copies, every variant's SQNR
at least ``SMOKE_SQNR_DB``; without a GPU in Triton's CPU interpreter, eager (``--eager``: inductor's
C++ compile would take minutes on a small CPU) and with the Triton kernels asked for by name
(``--backend triton``; ``auto`` picks the torch path off CUDA).
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from benchmarks.quant._common import (  # noqa: E402
    copies_for,
    device,
    run_interpreted,
    sqnr,
    table,
    time_graph_ms,
    write_json,
)
from lumenrl_quant import QuantizedLinear  # noqa: E402
from lumenrl_quant import triton_gemm as tg  # noqa: E402
from lumenrl_quant import triton_swiglu as ts  # noqa: E402
from lumenrl_quant.fp8 import quantize_fp8  # noqa: E402
from lumenrl_quant.fused_mlp import (  # noqa: E402
    SWIGLU_CONFIGS,
    SWIGLU_GROUP,
    _silu_mul_quantize_torch,
    swiglu_mlp_fp8,
    swiglu_mlp_fp8_tokenwise,
)

SHAPES = {"8b": (4096, 12288), "1.7b": (2048, 6144), "tiny": (128, 128)}  # tiny: the smoke run


def _up_sweep() -> list[dict[str, int]]:
    # session 5 call 1: block_k 256 was slower at 4 stages and out of shared memory at 5; 128 x 4 stages best
    out = [{"group": 64, "block_m": 64, "block_k": 256, "num_warps": 4, "num_stages": 3}]
    for group, warps, stages in itertools.product((64, 128), (4, 8), (3, 4)):
        out.append({"group": group, "block_m": 64, "block_k": 128, "num_warps": warps, "num_stages": stages})
    return out


def _down_sweep(group: int) -> list[dict[str, int]]:
    out = []
    for bn, bk, split, stages in itertools.product((32, 64, 128), (64, 128), (1, 2, 4), (4, 6)):
        if bk <= group:
            out.append({"block_m": 64, "block_n": bn, "block_k": bk, "split_k": split, "num_warps": 4,
                        "num_stages": stages})
    return out


def bench(model: str, m: int, tune: bool, given: dict | None, *, compiled: bool = True, backend: str = "auto",
          iters: int = 20) -> tuple[list[dict], dict | None]:
    k, inter = SHAPES[model]
    dev = device()
    copies = copies_for(3 * inter * k, cap=64 if dev.type == "cuda" else 2)  # FP8 bytes of one MLP
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [(torch.randn(2 * inter, k, generator=gen, device=dev) * 0.02,
                torch.randn(k, inter, generator=gen, device=dev) * 0.02) for _ in range(copies)]
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    w_up0, w_down0 = weights[0]
    xd = x.double()
    gu = xd @ w_up0.double().T
    exact = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down0.double().T
    layers = [(QuantizedLinear(k, 2 * inter, scheme="fp8_row", bias=False, weight=wu, device=dev),
               QuantizedLinear(inter, k, scheme="fp8_row", bias=False, weight=wd, device=dev)) for wu, wd in weights]
    bf16 = [(wu.bfloat16(), wd.bfloat16()) for wu, wd in weights]
    del weights
    rows: list[dict] = []
    base = None

    def add(variant: str, calls: list, out0=None, **extra) -> dict:
        nonlocal base
        row = {"model": model, "M": m, "variant": variant, **extra}
        try:
            if out0 is not None:
                row["sqnr_db"] = sqnr(exact, out0())
            ms, how = time_graph_ms(calls, iters=iters)
            row.update(us=ms * 1e3, timing=how, weight_gbs=3 * inter * k / ms / 1e6)
            if variant == "bf16":
                base = ms
                row["weight_gbs"] *= 2  # 16-bit weights
            row["x_bf16"] = base / ms if base else None
        except Exception as err:  # noqa: BLE001 - report, keep going
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        return row

    def mlp_bf16(t, wu, wd):
        g = F.linear(t, wu)
        return F.linear(F.silu(g[:, :inter]) * g[:, inter:], wd)

    def mlp_unfused(t, up, down):
        g = up(t)
        return down(F.silu(g[:, :inter]) * g[:, inter:])

    def mlp_token(t, up, down):
        return swiglu_mlp_fp8_tokenwise(t, up, down, backend=backend)

    wrap = torch.compile if compiled else (lambda fn: fn)
    c_bf16, c_unfused, c_token = wrap(mlp_bf16), wrap(mlp_unfused), wrap(mlp_token)
    add("bf16", [lambda w=w: c_bf16(x, *w) for w in bf16], lambda: c_bf16(x, *bf16[0]))
    add("fp8_unfused", [lambda lay=lay: c_unfused(x, *lay) for lay in layers], lambda: c_unfused(x, *layers[0]))
    add("fp8_token", [lambda lay=lay: c_token(x, *lay) for lay in layers], lambda: c_token(x, *layers[0]))
    if dev.type == "cuda":  # the SiLU * up + per-token quantize step alone, on an L2-resident gate/up output
        gu = layers[0][0](x)
        fp8 = layers[0][1].fp8_dtype
        c_silu = torch.compile(_silu_mul_quantize_torch)
        add("silu_inductor", [lambda: c_silu(gu, fp8)] * 8)
        add("silu_kernel_default", [lambda: ts.fp8_silu_mul_quantize(gu, fp8)] * 8)
        sweep = [(16384, 16, 1), (16384, 32, 1)]  # session 6 call 1's best single-program forms
        sweep += list(itertools.product((1024, 2048, 4096), (4, 8, 16), (2, 4, 8)))
        for block, warps, split in sweep:
            add("silu_kernel", [lambda c={"block": block, "num_warps": warps, "split": split}: ts.fp8_silu_mul_quantize(
                gu, fp8, config=c)] * 8, block=block, num_warps=warps, split=split)
    best = given
    if tune:
        a_q, a_s = quantize_fp8(x, granularity="rowwise")
        up_rows = []
        for cfg in _up_sweep():
            row = add("swiglu_kernel", [lambda lay=lay, c=cfg: tg.fp8_swiglu_quant(
                a_q, a_s, lay[0].weight, lay[0].weight_scale, out_dtype=lay[1].fp8_dtype, config=c) for lay in layers],
                **cfg)
            row["weight_gbs"] = 2 * inter * k / (row["us"] * 1e3) if "us" in row else None
            up_rows.append(row)
        best_up = {}
        for group in (64, 128):
            timed = [r for r in up_rows if "us" in r and r["group"] == group]
            if timed:
                best_up[group] = min(timed, key=lambda r: r["us"])
        down_best = {}
        for group, up_row in best_up.items():
            cfg_up = {key: up_row[key] for key in ("group", "block_m", "block_k", "num_warps", "num_stages")}
            h = tg.fp8_swiglu_quant(a_q, a_s, layers[0][0].weight, layers[0][0].weight_scale,
                                    out_dtype=layers[0][1].fp8_dtype, config=cfg_up)
            timed = []
            for cfg in _down_sweep(group):
                row = add("group_gemm_kernel", [lambda lay=lay, c=cfg, h=h, g=group: tg.fp8_group_act_gemm(
                    h[0], h[1], lay[1].weight, lay[1].weight_scale, group=g, config=c) for lay in layers],
                    group=group, **cfg)
                if "us" in row:
                    row["weight_gbs"] = inter * k / (row["us"] * 1e3)
                    timed.append(row)
            if timed:
                down_best[group] = min(timed, key=lambda r: r["us"])
        pairs = {g: best_up[g]["us"] + down_best[g]["us"] for g in down_best}
        if pairs:
            group = min(pairs, key=pairs.get)
            keys_down = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
            best = {"group": group,
                    "up": {key: best_up[group][key] for key in ("block_m", "block_k", "num_warps", "num_stages")},
                    "down": {key: down_best[group][key] for key in keys_down}, "kernels_us": pairs[group],
                    "shape": {"K": k, "I": inter}}
    # untuned: the engine's group and launch configurations (SWIGLU_CONFIGS / DOWN_CONFIGS). Session 6's
    # calls 1-2 ran group 64 here with default launch configs (115.8 us): not what the engine runs
    group = best["group"] if best else SWIGLU_CONFIGS.get((inter, k), {}).get("group", SWIGLU_GROUP)
    cfgs = (best["up"], best["down"]) if best else None

    def fused(t, up, down):
        return swiglu_mlp_fp8(t, up, down, group=group, backend=backend, configs=cfgs)

    c_fused = wrap(fused)
    add("fp8_fused", [lambda lay=lay: c_fused(x, *lay) for lay in layers], lambda: c_fused(x, *layers[0]),
        group=group)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="8b")
    ap.add_argument("--m", default="64", help="decode batch sizes (comma separated)")
    ap.add_argument("--tune", action="store_true", help="sweep the two kernels' launch configurations (only at --m 64)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (smoke runs on the CPU)")
    ap.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                    help="the fused and tokenwise MLPs' kernel backend")
    ap.add_argument("--iters", type=int, default=20, help="timed replays per variant")
    ap.add_argument("--out", default="fused_mlp.json")
    args = ap.parse_args(argv)
    if args.tune and args.m != "64":  # the engine's table is per shape, not per M (mlp_override installs it so)
        ap.error(f"--m {args.m!r} with --tune: the sweep tunes the decode MLP at M = 64 only (the engine's launch "
                 "configurations are per shape, tuned at decode batch 64); give --m 64 or drop --tune")
    rows, best_by = [], {}
    for model in args.models.split(","):
        for m in (int(v) for v in args.m.split(",")):
            found, best = bench(model, m, args.tune, None, compiled=not args.eager, backend=args.backend,
                                iters=args.iters)
            rows.extend(found)
            if best:
                best_by[f"{model}_M{m}"] = best
            write_json(args.out.removesuffix(".json"), {"rows": rows, "best": best_by})
    main_rows = [r for r in rows if r["variant"] in ("bf16", "fp8_unfused", "fp8_token", "fp8_fused")]
    print(table("SwiGLU MLP at decode (one CUDA graph over a weight rotation)", main_rows,
                ["model", "M", "variant", "group", "us", "weight_gbs", "x_bf16", "sqnr_db", "error"]))
    silu_rows = [r for r in rows if r["variant"].startswith("silu_")]
    if silu_rows:
        print(table("SiLU * up + per-token FP8 quantize alone, (M, 2I) bf16 in L2 (us per call)", silu_rows,
                    ["model", "M", "variant", "block", "num_warps", "split", "us", "error"]))
    for key, best in best_by.items():
        print(f"best {key}: {best}")
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} variants failed; first: {errors[0]}")
    return {"rows": rows, "best": best_by}


SMOKE_ARGS = ["--models", "tiny", "--m", "4", "--iters", "3", "--out", "fused_mlp_smoke.json"]
SMOKE_SQNR_DB = 15.0  # E4M3 x and down input, random tiny weights: 21-24 dB (interpreter or not); a wrong kernel: ~0


def run(smoke: bool) -> dict:
    """Suite entry: fused FP8 SwiGLU MLP vs the unfused FP8 MLP at decode (Qwen3-8B, M = 64).
    Smoke without a GPU: :func:`smoke` in Triton's CPU interpreter."""
    if smoke:
        return smoke() if torch.cuda.is_available() else run_interpreted("benchmarks.quant.bench_fused_mlp:smoke")
    return _numbers(main([])["rows"])


def smoke() -> dict:
    """The smoke run: every variant runs, with an SQNR against the float64 MLP of ``SMOKE_SQNR_DB`` or more."""
    cpu = ["--eager", "--backend", "triton"] if not torch.cuda.is_available() else []
    rows = main(SMOKE_ARGS + cpu)["rows"]
    failed = [f"{r['variant']}: {r['error']}" for r in rows if "error" in r]
    failed += [f"{r['variant']}: SQNR {r['sqnr_db']:.1f} dB" for r in rows if r.get("sqnr_db", math.inf) < SMOKE_SQNR_DB]
    if failed:
        raise RuntimeError(f"fused MLP variants failed: {failed}")
    return _numbers(rows)


def _numbers(rows: list[dict]) -> dict:
    us = {r["variant"]: r["us"] for r in rows if r["variant"] in ("fp8_unfused", "fp8_fused") and "us" in r}
    return {"fused_us": us["fp8_fused"], "unfused_us": us["fp8_unfused"], "fused_speedup": us["fp8_unfused"] / us["fp8_fused"]}


if __name__ == "__main__":
    main()
