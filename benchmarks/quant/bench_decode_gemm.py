"""Rowwise FP8 GEMMs at the native engine's decode shapes: cuBLAS variants vs the Triton split-K kernel.

The ``fp8_row`` rollout scheme's linears (per-token activation scales, per-channel weight scales)
at the fused Qwen3-8B decode shapes, M = batch: q/k/v (N 6144, K 4096), o (4096, 4096), gate/up
(24576, 4096), down (4096, 12288). Weights are cycled over enough copies that the working set is
several times the L2, and a whole rotation is timed inside one CUDA graph (as in a decode step).

Paths (all produce the scaled result, checked against the float32 emulation, rel. error <= 1e-2):

* ``bf16``: ``torch.mm`` of the bf16 operands (the baseline; speedup = bf16 us / path us);
* ``cublas_unit_fp32+epi``: the engine's current ``scaled_mm_rowwise_epilogue`` path as it runs in
  graph mode: cuBLAS tensorwise with unit scales into float32, then the Triton scale epilogue;
* ``cublas_unit_fp32``: the same GEMM alone (under ``torch.compile`` the epilogue fuses away);
* ``cublas_unit_bf16``: cuBLAS tensorwise with unit scales into bf16 (a kernel-choice probe; the
  result is not rowwise-scaled, so it is timed but not checked);
* ``cublas_rowwise``: ``torch._scaled_mm`` with rowwise scales (CUTLASS sm90 kernel);
* ``triton``: :func:`lumenrl_quant.triton_gemm.fp8_rowwise_gemm` per launch configuration
  (``--tune`` sweeps tiles, split-K and stages; the default config otherwise);
* ``triton_w8a16_<bfloat16|float16>``: :func:`lumenrl_quant.triton_gemm.fp8_weight_only_gemm`, bf16
  activations against the FP8 weight widened in registers (no activation quantization; checked against
  the bf16 x times the dequantized weight).

    python benchmarks/quant/bench_decode_gemm.py --tune
    python benchmarks/quant/bench_decode_gemm.py --tune --space wide   # block_k to 512, 3-7 stages, 4/8 warps
    python benchmarks/quant/bench_decode_gemm.py --tune --space table --tma 0,1 --no-w8a16  # the engine's tiles, TMA

Smoke (``run(True)``): M = 4 on one ``tiny`` shape (N 64, K 256), the same paths and checks, timed
over 2 weight copies; without a GPU in Triton's CPU interpreter, where the bf16-dot W8A16 variant is
left out (Triton 3.6's interpreter multiplies bf16 ``tl.dot`` operands as raw bits; the fp16 one runs).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.quant._common import copies_for, device, run_interpreted, table, time_graph_ms, write_json  # noqa: E402
from lumenrl_quant import triton_gemm as tg  # noqa: E402
from lumenrl_quant.fp8 import quantize_fp8  # noqa: E402
from lumenrl_quant.gemm import _torch_scaled_mm, run_gemm_path  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "tiny": (64, 256)}  # tiny: the smoke run
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as Triton reads it


def _sweep() -> list[dict[str, int]]:
    out = [dict(tg.DEFAULT_CONFIG)]
    for bn, bk, split, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (3, 5)):
        cfg = {**tg.DEFAULT_CONFIG, "block_n": bn, "block_k": bk, "split_k": split, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out


SMEM_BUDGET = 220_000  # bytes of shared memory a launch may use for its pipeline stages (H100/H200: 227 KB)


def _sweep_wide() -> list[dict[str, int]]:
    """Deeper pipelines and longer K tiles than :func:`_sweep` (FP8 tiles hold half the bytes of bf16 ones, so the
    same tile keeps half the bytes in flight): block_k up to 512, 3-7 stages, 4 or 8 warps, no split; only
    configurations whose stages fit :data:`SMEM_BUDGET` (FP8 A and B tiles: (block_m + block_n) x block_k bytes)."""
    out = [dict(tg.DEFAULT_CONFIG)]
    for bn, bk, stages, warps in itertools.product((32, 64), (256, 512), (3, 4, 5, 6, 7), (4, 8)):
        cfg = {**tg.DEFAULT_CONFIG, "block_n": bn, "block_k": bk, "split_k": 1, "num_stages": stages,
               "num_warps": warps}
        if stages * (cfg["block_m"] + bn) * bk <= SMEM_BUDGET and cfg not in out:
            out.append(cfg)
    return out


def _sweep_table() -> list[dict[str, int]]:
    """The default and the engine's measured configurations (``gemm.TRITON_ROWWISE_CONFIGS``), for an A/B of one
    launch option over the tiles the engine runs (e.g. ``--tma 0,1``)."""
    from lumenrl_quant.gemm import TRITON_ROWWISE_CONFIGS

    out = [dict(tg.DEFAULT_CONFIG)]
    for cfg in TRITON_ROWWISE_CONFIGS.values():
        cfg = {**tg.DEFAULT_CONFIG, **cfg}
        if cfg not in out:
            out.append(cfg)
    return out


def with_tma(configs: list[dict[str, int]], tmas: tuple[int, ...]) -> list[dict[str, int]]:
    """Each configuration once per ``tma`` value (0: pointer loads, 1: TMA tile copies)."""
    return [{**cfg, "tma": t} for t in tmas for cfg in configs]


def bench_shape(m: int, n: int, k: int, configs: list[dict[str, int]],
                w8a16_configs: list[dict[str, int]], iters: int = 20) -> list[dict]:
    dev = device()
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    a_q, sa = quantize_fp8(a, granularity="rowwise")
    cap = 64 if dev.type == "cuda" else 2  # the CPU (smoke) has no L2 to defeat
    copies = copies_for(n * k, cap=cap)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    quantized = [quantize_fp8(w, granularity="rowwise") for w in weights]
    ref = (a_q.float() * sa.float().reshape(-1, 1)) @ (quantized[0][0].float() * quantized[0][1].float().reshape(-1, 1)).T
    ref_w16 = a.float() @ (quantized[0][0].float() * quantized[0][1].float().reshape(-1, 1)).T  # W8A16
    one = torch.ones((), device=dev)
    rows, base = [], None

    def add(path: str, calls: list, bytes_per_call: int, check: bool = True, against=None, **extra) -> None:
        nonlocal base
        row = {"M": m, "N": n, "K": k, "path": path, **extra}
        want = ref if against is None else against
        try:
            if check:
                out = calls[0]()
                err = float((out.float() - want).norm() / want.norm())
                row["rel_err"] = err
                if not err <= 1e-2:
                    raise RuntimeError(f"relative error {err:.3g} > 1e-2 vs the float32 emulation")
            ms, how = time_graph_ms(calls, iters=iters)
            row.update(us=ms * 1e3, weight_gbs=bytes_per_call / ms / 1e6, timing=how)
            if path == "bf16":
                base = ms
            row["x_bf16"] = base / ms if base else None
        except Exception as err:  # noqa: BLE001 - report, keep going
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        rows.append(row)

    add("bf16", [lambda w=w: torch.mm(a, w.t()) for w in weights[: copies_for(2 * n * k, cap=cap)]], 2 * n * k,
        check=False)
    del weights
    add("cublas_unit_fp32+epi", [lambda q=q: run_gemm_path("scaled_mm_rowwise_epilogue", a_q, sa, q[0], q[1],
                                                           out_dtype=torch.bfloat16) for q in quantized], n * k)
    add("cublas_unit_fp32", [lambda q=q: torch._scaled_mm(a_q, q[0].t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.float32) for q in quantized], n * k, check=False)
    add("cublas_unit_bf16", [lambda q=q: torch._scaled_mm(a_q, q[0].t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16) for q in quantized], n * k, check=False)
    add("cublas_rowwise", [lambda q=q: _torch_scaled_mm("rowwise", a_q, sa, q[0], q[1], torch.bfloat16)
                           for q in quantized], n * k)
    for cfg in configs:
        if not tg.supports(k, cfg):
            continue
        add("triton_tma" if cfg.get("tma") else "triton",
            [lambda q=q, c=cfg: tg.fp8_rowwise_gemm(a_q, sa, q[0], q[1], config=c) for q in quantized],
            n * k, **{key: cfg[key] for key in ("block_n", "block_k", "split_k", "num_stages", "num_warps", "tma")})
    for dot in (torch.float16,) if _INTERPRETED else (torch.bfloat16, torch.float16):  # W8A16: no activation quantization
        for cfg in w8a16_configs:
            if not tg.supports(k, cfg):
                continue
            add(f"triton_w8a16_{str(dot).removeprefix('torch.')}",
                [lambda q=q, c=cfg, d=dot: tg.fp8_weight_only_gemm(a, q[0], q[1], dot_dtype=d, config=c)
                 for q in quantized], n * k, against=ref_w16,
                **{key: cfg[key] for key in ("block_n", "block_k", "split_k", "num_stages", "num_warps")})
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="64", help="decode batch sizes (comma separated)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tma", default="0", choices=("0", "1", "0,1"), help="tile loads: pointers (0), TMA copies (1)")
    ap.add_argument("--no-w8a16", action="store_true", help="leave out the weight-only FP8 kernel")
    ap.add_argument("--space", choices=("default", "wide", "table"), default="default",
                    help="--tune space of the rowwise kernel: default (tiles, split-K), wide (longer K tiles, deeper "
                         "pipelines, 4 or 8 warps) or table (the default and the engine's configurations)")
    ap.add_argument("--iters", type=int, default=20, help="timed replays per path")
    ap.add_argument("--out", default="quant_decode_gemm", help="detail JSON name (under $LUMENRL_BENCH_OUT)")
    args = ap.parse_args(argv)
    if args.space != ap.get_default("space") and not args.tune:
        ap.error(f"--space={args.space!r}: a sweep space, used only with --tune (without it the default "
                 "configuration runs); add --tune or drop --space")
    configs = ({"default": _sweep, "wide": _sweep_wide, "table": _sweep_table}[args.space]() if args.tune
               else [dict(tg.DEFAULT_CONFIG)])
    configs = with_tma(configs, tuple(int(t) for t in args.tma.split(",")))
    w8a16 = [] if args.no_w8a16 else [{**tg.DEFAULT_CONFIG, "block_n": bn, "block_k": bk, "num_stages": st}
             for bn, bk, st in itertools.product((32, 64), (128, 256), (3, 4, 5))] if args.tune else [dict(tg.DEFAULT_CONFIG)]
    rows, best = [], []
    for m in (int(x) for x in args.m.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            found = bench_shape(m, n, k, configs, w8a16, iters=args.iters)
            rows.extend(found)
            timed = [r for r in found if "us" in r]
            fixed = [r for r in timed if not r["path"].startswith("triton")]
            for kind in sorted({r["path"] for r in timed if r["path"].startswith("triton")}):
                fixed.append(min((r for r in timed if r["path"] == kind), key=lambda r: r["us"]))
            for r in fixed:
                r["shape"] = name
            best.extend(fixed)
            write_json(args.out, {"rows": rows, "summary": best})
    cols = ["shape", "M", "N", "K", "path", "block_n", "block_k", "split_k", "num_stages", "num_warps", "tma", "us",
            "weight_gbs", "x_bf16", "rel_err"]
    print(table("decode GEMMs, fp8_row (cuBLAS variants; best Triton config per shape)", best, cols))
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} variants failed; first: {errors[0]}")
    return {"rows": rows, "summary": best}


SMOKE_ARGS = ["--m", "4", "--shapes", "tiny", "--iters", "3", "--out", "quant_decode_gemm_smoke"]


def run(smoke: bool) -> dict:
    """Suite entry: the best fp8_row decode GEMM speedup over bf16 (M = 64, Qwen3-8B shapes).
    Smoke without a GPU: :func:`smoke` in Triton's CPU interpreter."""
    if smoke:
        return smoke() if torch.cuda.is_available() else run_interpreted("benchmarks.quant.bench_decode_gemm:smoke")
    return _numbers(main([]))


def smoke() -> dict:
    """The smoke run: every path must pass its check against the float32 emulation."""
    result = main(SMOKE_ARGS)
    failed = [f"{r['path']}: {r['error']}" for r in result["rows"] if "error" in r]
    if failed:
        raise RuntimeError(f"decode GEMM paths failed: {failed}")
    return _numbers(result)


def _numbers(result: dict) -> dict:
    best = max((r for r in result["summary"] if "x_bf16" in r), key=lambda r: r["x_bf16"])
    return {"best_fp8_speedup": best["x_bf16"], "best_path": f"{best['path']} {best['shape']}"}


if __name__ == "__main__":
    main()
