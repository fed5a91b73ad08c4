"""Quantize kernels: achieved GB/s against the measured device copy bandwidth, torch vs Triton.

GB/s counts the ideal bytes of one pass: read x once + write q + write scales (a tensorwise
quantize must read x twice, so its ceiling is ~2/3 of copy bandwidth by this measure). Also
checks that the Triton kernels are bit-identical to the torch path.

    python benchmarks/quant/bench_quantize.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device, table, time_ms, write_json  # noqa: E402

from lumenrl_quant.fp8 import quantize_fp8  # noqa: E402
from lumenrl_quant.mx import quantize_mx  # noqa: E402

CASES = [  # (name, granularity, block_size)
    ("fp8_tensorwise", "tensorwise", None),
    ("fp8_rowwise", "rowwise", None),
    ("fp8_block_1x128", "block", (1, 128)),
    ("fp8_block_128x128", "block", (128, 128)),
]


def copy_bandwidth(numel: int, dev: torch.device) -> float:
    x = torch.empty(numel, dtype=torch.bfloat16, device=dev).normal_()
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() * x.element_size() / ms / 1e6  # GB/s, read + write


def _out_bytes(result) -> int:
    if isinstance(result, tuple):
        return sum(t.numel() * t.element_size() for t in result)
    return result.data.numel() * result.data.element_size() + result.scale.numel()


def _bit_equal(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y) for x, y in zip(a, b))


def _mismatch(a, b) -> dict:
    qa, qb = a[0].view(torch.uint8).int(), b[0].view(torch.uint8).int()
    diff = (qa - qb).abs()
    return {"q_mismatch_frac": (diff > 0).float().mean().item(), "q_max_code_diff": int(diff.max().item()),
            "scale_equal": bool(torch.equal(a[1], b[1]))}


def run(smoke: bool = False) -> dict:
    dev = device()
    m, k = (256, 1024) if smoke else (8192, 8192)
    copy_gbs = copy_bandwidth(m * k * (1 if smoke else 4), dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    in_bytes = x.numel() * x.element_size()
    rows = []
    has_triton = dev.type == "cuda"
    for name, gran, block in CASES:
        backends = ["torch"] + (["triton"] if has_triton else [])
        outs = {}
        for backend in backends:
            try:
                fn = lambda b=backend, g=gran, bs=block: quantize_fp8(x, granularity=g, block_size=bs, backend=b)  # noqa: E731
                outs[backend] = fn()
                ms = time_ms(fn)
                gbs = (in_bytes + _out_bytes(outs[backend])) / ms / 1e6
                reads = 2 if gran == "tensorwise" else 1  # tensorwise must read x twice (amax, cast)
                moved = (reads * in_bytes + _out_bytes(outs[backend])) / ms / 1e6
                rows.append({"kernel": name, "backend": backend, "ms": ms, "GB/s": gbs,
                             "pct_copy": 100 * gbs / copy_gbs, "moved_pct_copy": 100 * moved / copy_gbs})
            except Exception as err:  # record, keep benchmarking the rest
                rows.append({"kernel": name, "backend": backend, "error": repr(err)[:200]})
        if "triton" in outs and "torch" in outs:
            rows[-1]["bit_identical_to_torch"] = _bit_equal(outs["triton"], outs["torch"])
            rows[-1].update(_mismatch(outs["triton"], outs["torch"]))
    for elem in ("e4m3", "e2m1"):
        outs = {}
        for backend in ["torch"] + (["triton"] if has_triton else []):
            try:
                fn = lambda e=elem, b=backend: quantize_mx(x, e, backend=b)  # noqa: E731
                outs[backend] = fn()
                ms = time_ms(fn, iters=10)
                gbs = (in_bytes + _out_bytes(outs[backend])) / ms / 1e6
                rows.append({"kernel": f"mx_{elem}", "backend": backend, "ms": ms, "GB/s": gbs,
                             "pct_copy": 100 * gbs / copy_gbs, "moved_pct_copy": 100 * gbs / copy_gbs})
            except Exception as err:
                rows.append({"kernel": f"mx_{elem}", "backend": backend, "error": repr(err)[:200]})
        if len(outs) == 2:
            a, b = outs["triton"], outs["torch"]
            rows[-1]["bit_identical_to_torch"] = _bit_equal((a.data, a.scale), (b.data, b.scale))
    payload = {"shape": [m, k], "input_dtype": "bfloat16", "copy_GBps": copy_gbs, "rows": rows}
    cols = ["kernel", "backend", "ms", "GB/s", "pct_copy", "moved_pct_copy", "bit_identical_to_torch"]
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read+write, bf16 {m}x{k}x{1 if smoke else 4})")
    print(table(f"quantize {m}x{k} bf16 -> fp8/mx", rows, cols))
    write_json("quant_quantize" + ("_smoke" if smoke else ""), payload)
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU sanity run)")
    run(parser.parse_args().smoke)
