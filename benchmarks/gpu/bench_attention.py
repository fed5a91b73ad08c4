"""Decode attention kernel alone: GB/s of K/V read, per launch configuration (``--tune``).

The native engine's split-KV GQA decode kernel (``lumenrl_backends.engines.triton_attention``) at
the engine's decode shape: Qwen3-8B heads (32 query / 8 KV heads, head dim 128), batch 64, a
preallocated cache of ``--cache`` columns (prompt 256 + 256 new = 512 in the decode benchmarks),
every row attending to ``--lengths`` columns (the bounded walk: the engine passes each row's last
column). bf16 and FP8 (E4M3, per-layer scales) caches. Each configuration is first checked against
float32 SDPA on the same (dequantized) values (relative error <= 2e-2; <= 1e-1 for the opt-in E4M3
dots, listed under their own key), then timed as device time
inside a CUDA graph (two K/V sets alternated so a call does not find the previous one's K/V in L2).
GB/s = K + V bytes the rows attend to / time; ``pct_copy`` against the copy bandwidth measured in
the same run. The best configuration per cache dtype is printed last; the kernel's default
(``DEFAULT_CONFIG`` / ``FP8_CONFIG``) is printed first.

    python benchmarks/gpu/bench_attention.py --tune --out attention_tune.json
    python benchmarks/gpu/bench_attention.py --tune --space fp8wide --dtypes fp8 --out attention_tune5.json
    python benchmarks/gpu/bench_attention.py --tune --space layouts --v-layouts rows,columns --out attention_tune6.json
    python benchmarks/gpu/bench_attention.py --tune --space vblocks --dtypes fp8 --v-layouts rows,blocks64,blocks128 \
        --out attention_tune7.json
    python benchmarks/gpu/bench_attention.py --tune --space structure --v-layouts rows,blocks128 --out attention_tune9.json
    python benchmarks/gpu/bench_attention.py --tune --space warp1 --dtypes fp8 --v-layouts blocks128 --out attention_tune10.json

Smoke (``run(True)``): ``--shape tiny`` (2 KV heads x 4, head dim 32), batch 1, 40 of 64 columns, the
same checks and timing; without a GPU in Triton's CPU interpreter, where the bf16 cache is read with
a float32 query (the kernel's float32-query path: Triton 3.6's interpreter multiplies bf16 ``tl.dot``
operands as raw bits).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

import benchmarks.gpu._common as C  # noqa: E402
from benchmarks.quant._common import run_interpreted  # noqa: E402
from lumenrl_backends.engines import triton_attention as ta  # noqa: E402

HEADS = {"8b": (8, 4, 128), "0.6b": (8, 2, 128), "tiny": (2, 4, 32)}  # KV heads, query heads per KV head, head dim
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as Triton reads it


def _sweep() -> list[dict[str, int]]:
    configs = [dict(ta.DEFAULT_CONFIG), dict(ta.FP8_CONFIG)]
    for k_trans, block_n, chunk, warps, stages in itertools.product((0, 1), (32, 64, 128), (0, 256), (4, 8), (2, 3, 4)):
        cfg = {"block_n": block_n, "chunk": chunk, "num_warps": warps, "num_stages": stages, "k_trans": k_trans}
        if cfg not in configs:
            configs.append(cfg)
    for fp8_dots, k_trans, block_n, stages in itertools.product((1, 2), (0, 1), (32, 64, 128), (2, 3, 4)):
        configs.append({"block_n": block_n, "chunk": 0, "num_warps": 4, "num_stages": stages, "k_trans": k_trans,
                        "fp8_dots": fp8_dots})  # E4M3 caches only
    return configs


def _sweep_fp8_wide() -> list[dict[str, int]]:
    """FP8 cache, fp16 dots: smaller programs and more of them (1-2 warps, 16-column blocks,
    128-column splits) next to the default, deeper pipelines. Session 4 question: is the FP8 kernel
    (45% of copy bandwidth against 75% for bf16) short of loads in flight or of issue slots?"""
    configs = [dict(ta.FP8_CONFIG)]
    for block_n, warps, stages, chunk in itertools.product((16, 32, 64), (1, 2, 4), (2, 3, 4, 5), (0, 128)):
        cfg = {"block_n": block_n, "chunk": chunk, "num_warps": warps, "num_stages": stages, "k_trans": 0, "fp8_dots": 0}
        if cfg not in configs:
            configs.append(cfg)
    return configs


def _sweep_layouts() -> list[dict[str, int]]:
    """The V-layout comparison (``--v-layouts rows,columns``): a few configurations around each default."""
    configs = [dict(ta.DEFAULT_CONFIG), dict(ta.FP8_CONFIG)]
    for block_n, stages in itertools.product((32, 64, 128), (2, 3, 4)):
        cfg = {**ta.DEFAULT_CONFIG, "block_n": block_n, "num_stages": stages}
        if cfg not in configs:
            configs.append(cfg)
    return configs


def _sweep_vblocks() -> list[dict[str, int]]:
    """V stored in (D, T) tiles (``--v-layouts rows,blocks64,blocks128``): the p.v product reads each tile
    K-major (no 8-bit transpose), for fp16 and E4M3 dots. Session 8 question: is the FP8 kernel bound by
    the V tile's layout shuffle?"""
    configs = [dict(ta.FP8_CONFIG)]
    for block_n, stages, warps, dots, chunk in itertools.product((32, 64), (2, 3, 4), (4, 8), (0, 2), (0, 128)):
        cfg = {"block_n": block_n, "chunk": chunk, "num_warps": warps, "num_stages": stages, "k_trans": 0,
               "fp8_dots": dots}
        if cfg not in configs:
            configs.append(cfg)
    return configs


def _sweep_structure() -> list[dict[str, int]]:
    """Fewer, larger tiles (each tile pays two cross-warp reductions and a layout change of p through
    shared memory, 8 barriers in the FP8 kernel's SASS, ``diag_attention_kernel.py``) and the visibility
    mask loaded one tile ahead (``mask_ahead``: Triton leaves that load synchronous). Session 8."""
    configs = [dict(ta.DEFAULT_CONFIG), dict(ta.FP8_CONFIG)]
    for block_n, warps, stages, ahead, k_trans in itertools.product((64, 128), (2, 4, 8), (2, 3), (0, 1), (0, 1)):
        cfg = {"block_n": block_n, "chunk": 0, "num_warps": warps, "num_stages": stages, "k_trans": k_trans,
               "fp8_dots": 0, "mask_ahead": ahead}
        if cfg not in configs:
            configs.append(cfg)
    return configs


def _sweep_warp1() -> list[dict[str, int]]:
    """One- and two-warp programs over (D, 128) tiles, with splits (``chunk``) to fill the machine: a
    one-warp program needs no cross-warp reductions (no barriers in its loop). Session 8."""
    configs = [dict(ta.FP8_CONFIG)]
    for warps, block_n, stages, chunk in itertools.product((1, 2), (64, 128), (2, 3, 4), (0, 128, 256)):
        cfg = {"block_n": block_n, "chunk": chunk, "num_warps": warps, "num_stages": stages, "k_trans": 0,
               "fp8_dots": 0, "mask_ahead": 1}
        if cfg not in configs:
            configs.append(cfg)
    return configs


def _v_layout(v: torch.Tensor, layout: str) -> torch.Tensor:
    """rows: (B, H, L, D) as made; columns: (D, L) per head, viewed (B, H, L, D); blocksT: (B, H, L / T, D, T)."""
    if layout == "columns":  # tried for the FP8 cache in session 4; the engine stores rows
        return v.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout.startswith("blocks"):
        t = int(layout.removeprefix("blocks"))
        b, h, length, d = v.shape
        return v.reshape(b, h, length // t, t, d).transpose(-1, -2).contiguous()
    return v


def inputs(batch: int, kv_heads: int, groups: int, dim: int, cache: int, length: int, dtype: torch.dtype, seed: int,
           v_layout: str = "rows"):
    gen = torch.Generator(device=C.DEVICE).manual_seed(seed)
    q_dtype = torch.float32 if _INTERPRETED and dtype == torch.bfloat16 else torch.bfloat16  # see the module doc
    q = torch.randn((batch, kv_heads, groups, dim), generator=gen, device=C.DEVICE).to(q_dtype)
    k = torch.randn((batch, kv_heads, cache, dim), generator=gen, device=C.DEVICE)
    v = torch.randn((batch, kv_heads, cache, dim), generator=gen, device=C.DEVICE)
    last = torch.full((batch,), length - 1, device=C.DEVICE, dtype=torch.int64)
    allowed = torch.arange(cache, device=C.DEVICE)[None, :] <= last[:, None]
    scales = (None, None)
    if dtype == torch.bfloat16:
        k, v = k.to(dtype), v.to(dtype)
        ref_k, ref_v = k.float(), v.float()
    else:
        scales = (k.abs().amax() / 448.0).reshape(1), (v.abs().amax() / 448.0).reshape(1)
        k, v = (k / scales[0]).to(dtype), (v / scales[1]).to(dtype)
        ref_k, ref_v = k.float() * scales[0], v.float() * scales[1]
    v = _v_layout(v, v_layout)
    return q, k, v, allowed, last, scales, ref_k, ref_v


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=sorted(HEADS), help="heads: 8b (Qwen3-8B), 0.6b (Qwen3-0.6B: the GRPO benchmark's rollout) or tiny (smoke)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--lengths", default="384", help="columns each row attends to (comma separated)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--tune", action="store_true", help="sweep launch configurations (else: the default only)")
    ap.add_argument("--v-layouts", default="rows",
                    help="V stored by rows (L, D), columns (D, L) and/or (D, T) tiles (blocks64, ...), comma separated")
    ap.add_argument("--space", default="default", choices=("default", "fp8wide", "layouts", "vblocks", "structure", "warp1"),
                    help="--tune space: default (both dtypes, incl. E4M3 dots) or fp8wide (see _sweep_fp8_wide)")
    ap.add_argument("--iters", type=int, default=20, help="timed replays per configuration")
    ap.add_argument("--out", default="attention_tune.json")
    args = ap.parse_args(argv)
    if args.space != ap.get_default("space") and not args.tune:
        ap.error(f"--space={args.space!r}: a sweep space, used only with --tune (without it the kernel's "
                 "default configuration runs); add --tune or drop --space")
    kv_heads, groups, dim = HEADS[args.shape]
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args)}
    copy_gbs = C.copy_bandwidth_gbs()
    result["copy_bandwidth_gbs"] = copy_gbs
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; torch {torch.__version__}")
    space = {"fp8wide": _sweep_fp8_wide, "layouts": _sweep_layouts, "vblocks": _sweep_vblocks,
             "structure": _sweep_structure, "warp1": _sweep_warp1}.get(args.space, _sweep)
    configs = space() if args.tune else [None]  # None: the kernel's default for the cache dtype
    rows, best = [], {}
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for name, length, layout in itertools.product(args.dtypes.split(","), (int(x) for x in args.lengths.split(",")),
                                                  args.v_layouts.split(",")):
        dtype = dtypes[name]
        sets = [inputs(args.batch, kv_heads, groups, dim, args.cache, length, dtype, seed, layout)
                for seed in (1, 2)]
        q, _, _, allowed, _, _, ref_k, ref_v = sets[0]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), ref_k, ref_v, attn_mask=allowed[:, None, None, :], scale=dim**-0.5)
        moved = 2 * args.batch * kv_heads * length * dim * (1 if name == "fp8" else 2)
        for cfg in configs:
            if cfg and cfg.get("fp8_dots") and name != "fp8":
                continue
            if layout.startswith("blocks") and int(layout.removeprefix("blocks")) % ta._config(cfg, name == "fp8")["block_n"]:
                continue  # a tile must hold whole column blocks
            row = {"dtype": name, "length": length, "v_layout": layout, **ta._config(cfg, fp8=name == "fp8")}
            try:
                q, k, v, allowed, last, scales, _, _ = sets[0]
                out = ta._run(q, k, v, allowed, dim**-0.5, k_scale=scales[0], v_scale=scales[1], last=last, config=cfg)
                err = float((out.float() - ref).norm() / ref.norm())
                row["rel_err"] = err
                bound = 1e-1 if row["fp8_dots"] else 2e-2  # E4M3 dots: timed, reported apart, never "best"
                if not err <= bound:
                    raise RuntimeError(f"relative error {err:.3g} > {bound}")
                fns = [lambda s=s, c=cfg: ta._run(s[0], s[1], s[2], s[3], dim**-0.5, k_scale=s[5][0], v_scale=s[5][1],
                                                 last=s[4], config=c) for s in sets]
                ms, how = C.time_graph_ms(fns, iters=args.iters)
                row.update(us=ms * 1e3, gbs=moved / (ms * 1e-3) / 1e9, timing=how)
                row["pct_copy"] = 100 * row["gbs"] / copy_gbs
            except Exception as err:  # noqa: BLE001 - report, keep sweeping
                row["error"] = f"{type(err).__name__}: {err}"[:200]
            rows.append(row)
            key = (f"{name}_L{length}" + (f"_fp8dots{row['fp8_dots']}" if row["fp8_dots"] else "")
                   + ("" if layout == "rows" else f"_v{layout}") + ("_ahead" if row["mask_ahead"] else ""))
            if "gbs" in row and (key not in best or row["gbs"] > best[key]["gbs"]):
                best[key] = row
        del sets
        torch.cuda.empty_cache()
        result.update(rows=rows, best=best)
        C.write_json(args.out, result)
    default = [r for r in rows if all(r.get(k) == v for k, v in ta._config(None, fp8=r["dtype"] == "fp8").items())]
    print("default configuration:")
    C.print_table(default, ["dtype", "length", "v_layout", "block_n", "chunk", "num_warps", "num_stages", "k_trans", "fp8_dots", "mask_ahead", "us",
                            "gbs", "pct_copy", "rel_err", "error"])
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} configurations failed, first: {errors[0]}")
    print("best configuration per cache dtype and length:")
    C.print_table(list(best.values()), ["dtype", "length", "v_layout", "block_n", "chunk", "num_warps", "num_stages", "k_trans", "fp8_dots", "mask_ahead",
                                        "us", "gbs", "pct_copy", "rel_err"])
    return {"rows": rows, "default": default}


SMOKE_ARGS = ["--shape", "tiny", "--batch", "1", "--cache", "64", "--lengths", "40", "--iters", "3",
              "--out", "attention_smoke.json"]


def run(smoke: bool) -> dict:
    """Suite entry: decode attention microseconds per call, default configuration (8B heads, batch 64).
    Smoke without a GPU: :func:`smoke` in Triton's CPU interpreter."""
    if smoke and not torch.cuda.is_available():
        return run_interpreted("benchmarks.gpu.bench_attention:smoke")
    return _numbers(main(SMOKE_ARGS if smoke else ["--out", "attention.json"])["rows"])


def smoke() -> dict:
    """The smoke run (tiny heads, checked against float32 SDPA like the full run)."""
    return _numbers(main(SMOKE_ARGS)["rows"])


def _numbers(rows: list[dict]) -> dict:
    failed = [r["error"] for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"attention configurations failed: {failed}")
    us = {r["dtype"]: r["us"] for r in rows}
    return {"bf16_us": us["bf16"], "fp8_us": us["fp8"]}


if __name__ == "__main__":
    main()
