"""QuantizedLinear forward (dynamic activation quantization included) vs a BF16 nn.Linear.

Decode M = 1..256 cycle over enough layers that the weights come from HBM; training-sized M
(4096, 8192) run one layer. The MX schemes have no tensor-core path on Hopper: their forward
dequantizes the weight (emulation), so they are expected to be slower than BF16 here.
``fp8_row`` at decode M (<= 256) runs the ``scaled_mm_rowwise_epilogue`` GEMM path (cuBLAS
tensorwise with unit scales into float32 + a scale epilogue); ``fp8_row_cutlass`` is the same
layer forced onto torch's single rowwise ``_scaled_mm`` kernel (the path before), for comparison.
The ``path`` column names the GEMM path each row ran.

    python benchmarks/quant/bench_linear.py [--smoke]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.quant._common import (  # noqa: E402
    copies_for,
    device,
    table,
    time_graph_ms,
    time_ms,
    time_rotating_ms,
    write_json,
)
from lumenrl_quant import gemm  # noqa: E402
from lumenrl_quant.linear import LINEAR_SCHEMES, QuantizedLinear  # noqa: E402

_WEIGHT_BYTES = {"bf16": 2.0, "fp8_block": 1.0, "fp8_row": 1.0, "fp8_row_cutlass": 1.0, "fp8_tensor": 1.0,
                 "mxfp8": 1.0, "mxfp4": 0.5}
VARIANTS = {"fp8_row_cutlass": "fp8_row"}  # variant -> scheme, built with ROWWISE_EPILOGUE_MAX_M = 0


def _quantized(lin: nn.Linear, scheme: str) -> QuantizedLinear:
    if scheme not in VARIANTS:
        return QuantizedLinear.from_linear(lin, scheme)
    saved, gemm.ROWWISE_EPILOGUE_MAX_M = gemm.ROWWISE_EPILOGUE_MAX_M, 0  # paths are chosen at construction
    try:
        return QuantizedLinear.from_linear(lin, VARIANTS[scheme])
    finally:
        gemm.ROWWISE_EPILOGUE_MAX_M = saved


def _layers(scheme: str, n: int, k: int, copies: int, dev: torch.device) -> list[nn.Module]:
    out = []
    for _ in range(copies):
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02)
        out.append(lin if scheme == "bf16" else _quantized(lin, scheme))
    return out


def _bench(m: int, n: int, k: int, schemes: list[str], dev: torch.device, rotate: bool) -> list[dict]:
    rows, base = [], None
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    for scheme in schemes:
        try:
            wbytes = int(n * k * _WEIGHT_BYTES[scheme])
            copies = copies_for(wbytes) if rotate else 1
            layers = _layers(scheme, n, k, copies, dev)
            with torch.no_grad():
                calls = [lambda layer=layer: layer(x) for layer in layers]
                if rotate:
                    eager = time_rotating_ms(calls)
                    ms, timing = time_graph_ms(calls)
                else:
                    eager = ms = time_ms(calls[0], iters=10)
                    timing = "eager"
            base = ms if scheme == "bf16" else base
            path = layers[0].gemm_path_for(m, x.dtype) if scheme != "bf16" else "bf16"
            rows.append({"M": m, "N": n, "K": k, "scheme": scheme, "path": path, "us": ms * 1e3, "us_eager": eager * 1e3,
                         "timing": timing, "TFLOP/s": 2 * m * n * k / ms / 1e9,
                         "speedup_vs_bf16": base / ms if base else None})
            del layers, calls
        except Exception as err:
            rows.append({"M": m, "N": n, "K": k, "scheme": scheme, "error": repr(err)[:200]})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(smoke: bool = False, schemes: list[str] | None = None, training: bool = True) -> dict:
    dev = device()
    allowed = ["bf16", *LINEAR_SCHEMES[:2], *VARIANTS, *LINEAR_SCHEMES[2:]]
    schemes = schemes or allowed
    bad = [s for s in schemes if s not in allowed]
    if bad:
        raise ValueError(f"schemes {bad} are unknown; allowed: {allowed}")
    if schemes[0] != "bf16":
        schemes = ["bf16", *[s for s in schemes if s != "bf16"]]  # the speedup column needs the bf16 baseline
    rotate = dev.type == "cuda"
    decode_ms = [1, 16] if smoke else [1, 8, 32, 64, 128, 256]
    nk = [(64, 128)] if smoke else [(4096, 4096), (14336, 4096), (4096, 12288)]
    big = [(128, 128, 128)] if smoke else [(4096, 4096, 4096), (8192, 8192, 8192)]
    decode = [r for n, k in nk for m in decode_ms for r in _bench(m, n, k, schemes, dev, rotate)]
    training = [r for m, n, k in big for r in _bench(m, n, k, schemes, dev, rotate=False)] if training else []
    cols = ["M", "N", "K", "scheme", "path", "us", "us_eager", "timing", "TFLOP/s", "speedup_vs_bf16"]
    print(table("QuantizedLinear forward, decode shapes (layers cycled beyond L2; us = CUDA-graph replay)",
                decode, cols))
    print(table("QuantizedLinear forward, training-sized shapes", training, cols))
    payload = {"decode": decode, "training": training}
    write_json("quant_linear" + ("_smoke" if smoke else "") + ("" if schemes == allowed else "_subset"), payload)
    return payload


def bench(smoke: bool) -> dict:
    """Suite entry: the best low-precision speedup over bf16 at the decode shapes (and where it is)."""
    rows = [r for r in run(smoke)["decode"] if r.get("scheme", "bf16") != "bf16" and "speedup_vs_bf16" in r]
    best = max(rows, key=lambda r: r["speedup_vs_bf16"])
    return {"best_fp8_speedup": best["speedup_vs_bf16"], "best_path": f"{best['scheme']} M={best['M']} N={best['N']} K={best['K']}"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--schemes", default=None, help="comma separated subset, e.g. bf16,fp8_row,fp8_row_cutlass")
    parser.add_argument("--no-training", action="store_true", help="decode shapes only")
    args = parser.parse_args()
    run(args.smoke, args.schemes.split(",") if args.schemes else None, training=not args.no_training)
