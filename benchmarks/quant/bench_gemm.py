"""FP8 GEMM vs BF16: decode shapes (M = 1..256) and training shapes (M = N = K = 4096, 8192).

Operands are pre-quantized (GEMM time only). Decode shapes cycle over enough weight copies that
the working set exceeds the L2, so the weight read comes from HBM as in a real decode step.
Paths: bf16 ``torch.mm``; ``torch._scaled_mm`` tensorwise / rowwise / blockwise (1x128 x 128x128);
the Triton blockwise kernel. Speedup = bf16 time / path time.

    python benchmarks/quant/bench_gemm.py [--smoke]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.quant._common import (  # noqa: E402
    copies_for,
    device,
    table,
    time_graph_ms,
    time_ms,
    time_rotating_ms,
    write_json,
)
from lumenrl_quant.fp8 import quantize_fp8  # noqa: E402
from lumenrl_quant.gemm import _torch_scaled_mm  # noqa: E402

LAYOUTS = {  # mode -> (a granularity, a block, b granularity, b block)
    "tensorwise": ("tensorwise", None, "tensorwise", None),
    "rowwise": ("rowwise", None, "rowwise", None),
    "blockwise": ("block", (1, 128), "block", (128, 128)),
}


def _paths(has_triton: bool) -> list[str]:
    return ["bf16", "tensorwise", "rowwise", "blockwise"] + (["triton_blockwise"] if has_triton else [])


def _make_call(path: str, a: torch.Tensor, w: torch.Tensor):
    if path == "bf16":
        return lambda: torch.mm(a, w.t())
    mode = "blockwise" if path == "triton_blockwise" else path
    ga, ba, gb, bb = LAYOUTS[mode]
    a_q, sa = quantize_fp8(a, granularity=ga, block_size=ba)
    w_q, sw = quantize_fp8(w, granularity=gb, block_size=bb)
    if path == "triton_blockwise":
        from lumenrl_quant.triton_kernels import fp8_blockwise_gemm

        return lambda: fp8_blockwise_gemm(a_q, sa, w_q, sw, out_dtype=torch.bfloat16)
    return lambda: _torch_scaled_mm(mode, a_q, sa, w_q, sw, torch.bfloat16)


def _bench_shape(m: int, n: int, k: int, paths: list[str], dev: torch.device, rotate: bool) -> list[dict]:
    rows, base = [], None
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    for path in paths:
        try:
            per_copy = n * k * (2 if path == "bf16" else 1)
            copies = copies_for(per_copy) if rotate else 1
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            calls = [_make_call(path, a, w) for w in ws]
            del ws
            if rotate:  # decode: one CUDA graph over all copies (as an engine's decode step)
                eager = time_rotating_ms(calls)
                ms, timing = time_graph_ms(calls)
            else:
                eager = ms = time_ms(calls[0], iters=20)
                timing = "eager"
            base = ms if path == "bf16" else base
            tflops = 2 * m * n * k / ms / 1e9
            row = {"M": m, "N": n, "K": k, "path": path, "us": ms * 1e3, "us_eager": eager * 1e3, "timing": timing,
                   "TFLOP/s": tflops, "weight_GB/s": per_copy / ms / 1e6, "speedup_vs_bf16": (base / ms) if base else None}
        except Exception as err:
            row = {"M": m, "N": n, "K": k, "path": path, "error": repr(err)[:200]}
        rows.append(row)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    return rows


def triton_advice(rows: list[dict]) -> dict[str, list[int]]:
    """Per (N, K): the M values where the Triton blockwise GEMM is faster than cuBLAS blockwise
    (M where cuBLAS has no kernel count as Triton wins)."""
    by = {}
    for r in rows:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["path"]] = r.get("us")
    out: dict[str, list[int]] = {}
    for (n, k, m), t in sorted(by.items()):
        tri, cub = t.get("triton_blockwise"), t.get("blockwise")
        if tri is not None and (cub is None or tri < cub):
            out.setdefault(f"{n}x{k}", []).append(m)
    return out


def run(smoke: bool = False) -> dict:
    dev = device()
    has_triton = dev.type == "cuda"
    paths = _paths(has_triton) if dev.type == "cuda" else ["bf16", "tensorwise"]  # CPU: smoke only
    decode_ms = [1, 16] if smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    decode_nk = [(64, 128)] if smoke else [(4096, 4096), (14336, 4096), (4096, 14336)]
    train = [128] if smoke else [4096, 8192]
    rotate = dev.type == "cuda"
    decode = [r for n, k in decode_nk for m in decode_ms for r in _bench_shape(m, n, k, paths, dev, rotate)]
    training = [r for s in train for r in _bench_shape(s, s, s, paths, dev, rotate=False)]
    cols = ["M", "N", "K", "path", "us", "us_eager", "TFLOP/s", "weight_GB/s", "speedup_vs_bf16"]
    print(table("decode-shaped GEMM (weights cycled beyond L2; us = CUDA-graph replay)", decode, cols))
    print(table("training-shaped GEMM", training, cols))
    advice = triton_advice(decode)
    print("Triton blockwise beats cuBLAS blockwise at M:", advice)
    payload = {"decode": decode, "training": training, "triton_beats_cublas_at": advice}
    write_json("quant_gemm" + ("_smoke" if smoke else ""), payload)
    return payload


def bench(smoke: bool) -> dict:
    """Suite entry: the best low-precision speedup over bf16 at the decode shapes (and where it is)."""
    rows = [r for r in run(smoke)["decode"] if r.get("path", "bf16") != "bf16" and "speedup_vs_bf16" in r]
    best = max(rows, key=lambda r: r["speedup_vs_bf16"])
    return {"best_fp8_speedup": best["speedup_vs_bf16"], "best_path": f"{best['path']} M={best['M']} N={best['N']} K={best['K']}"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    run(parser.parse_args().smoke)
