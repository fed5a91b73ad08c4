"""GPU paths vs the CPU emulation: FP8/MX quantize bit-exactness, GEMM and QuantizedLinear agreement.

For each check the same inputs run on the GPU path (cuBLAS ``_scaled_mm``, Triton kernels, GPU
torch ops) and on the CPU reference (torch quantize + float32 emulated GEMM); we report whether
quantized bytes and scales are identical, and the SQNR of GEMM outputs against the CPU result.

    python benchmarks/quant/bench_agreement.py [--smoke]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.quant._common import device, sqnr, table, write_json  # noqa: E402
from lumenrl_quant.fp8 import quantize_fp8  # noqa: E402
from lumenrl_quant.gemm import emulated_scaled_mm, gemm_path, scaled_mm  # noqa: E402
from lumenrl_quant.linear import LINEAR_SCHEMES, QuantizedLinear  # noqa: E402
from lumenrl_quant.mx import quantize_mx  # noqa: E402

LAYOUTS = {
    "tensorwise": ("tensorwise", None, "tensorwise", None),
    "rowwise": ("rowwise", None, "rowwise", None),
    "blockwise": ("block", (1, 128), "block", (128, 128)),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def quantize_rows(x_cpu: torch.Tensor, dev: torch.device) -> list[dict]:
    rows = []
    backends = ["torch", "triton"] if dev.type == "cuda" else ["torch"]
    for name, (gran, block, _, _) in {"tensorwise": LAYOUTS["tensorwise"], "rowwise": LAYOUTS["rowwise"],
                                      "block_1x128": LAYOUTS["blockwise"]}.items():
        ref = quantize_fp8(x_cpu, granularity=gran, block_size=block, backend="torch")
        for backend in backends:
            try:
                got = quantize_fp8(x_cpu.to(dev), granularity=gran, block_size=block, backend=backend)
                rows.append({"check": f"fp8 quantize {name}", "gpu_path": backend,
                             "q_identical": _same(got[0], ref[0]), "scale_identical": _same(got[1], ref[1])})
            except Exception as err:
                rows.append({"check": f"fp8 quantize {name}", "gpu_path": backend, "error": repr(err)[:200]})
    w_ref = quantize_fp8(x_cpu, granularity="block", block_size=(128, 128), backend="torch")
    for backend in backends:
        got = quantize_fp8(x_cpu.to(dev), granularity="block", block_size=(128, 128), backend=backend)
        rows.append({"check": "fp8 quantize block_128x128", "gpu_path": backend,
                     "q_identical": _same(got[0], w_ref[0]), "scale_identical": _same(got[1], w_ref[1])})
    for elem in ("e4m3", "e5m2", "e2m1"):
        ref = quantize_mx(x_cpu, elem)
        for backend in backends:
            got = quantize_mx(x_cpu.to(dev), elem, backend=backend)
            rows.append({"check": f"mx quantize {elem}", "gpu_path": backend,
                         "q_identical": _same(got.data, ref.data), "scale_identical": _same(got.scale, ref.scale)})
    return rows


def gemm_rows(m: int, n: int, k: int, dev: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.02
    exact = a.double() @ b.double().t()
    for mode, (ga, ba, gb, bb) in LAYOUTS.items():
        a_q, sa = quantize_fp8(a, granularity=ga, block_size=ba)
        b_q, sb = quantize_fp8(b, granularity=gb, block_size=bb)
        cpu = emulated_scaled_mm(a_q, sa, b_q, sb, out_dtype=torch.float32, a_block_size=ba, b_block_size=bb)
        args = [t.to(dev) for t in (a_q, sa, b_q, sb)]
        paths = [gemm_path(*args, a_block_size=ba, b_block_size=bb)]
        if mode == "blockwise" and dev.type == "cuda":
            paths.append("triton_blockwise")
        for path in paths:
            try:
                if path == "triton_blockwise":
                    from lumenrl_quant.triton_kernels import fp8_blockwise_gemm

                    out = fp8_blockwise_gemm(*args, out_dtype=torch.bfloat16)
                else:
                    out = scaled_mm(*args, out_dtype=torch.bfloat16, a_block_size=ba, b_block_size=bb)
                rows.append({"check": f"gemm {mode} {m}x{n}x{k}", "gpu_path": path,
                             "sqnr_vs_cpu_emulation_db": sqnr(cpu, out.float()),
                             "sqnr_vs_float64_db": sqnr(exact, out.float()),
                             "cpu_emulation_vs_float64_db": sqnr(exact, cpu)})
            except Exception as err:
                rows.append({"check": f"gemm {mode}", "gpu_path": path, "error": repr(err)[:200]})
    return rows


def linear_rows(m: int, n: int, k: int, dev: torch.device) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    x = torch.randn(m, k)
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    for scheme in LINEAR_SCHEMES:
        try:
            cpu = QuantizedLinear.from_linear(lin, scheme)(x)
            gpu_layer = QuantizedLinear.from_linear(lin.to(dev), scheme)
            lin.cpu()
            gpu = gpu_layer(x.to(dev, torch.bfloat16)).float()
            rows.append({"check": f"linear {scheme} {m}x{n}x{k}", "gpu_path": "bf16 in/out",
                         "sqnr_vs_cpu_emulation_db": sqnr(cpu, gpu), "sqnr_vs_float64_db": sqnr(exact, gpu),
                         "cpu_emulation_vs_float64_db": sqnr(exact, cpu),
                         "weights_identical": _same(gpu_layer.weight, QuantizedLinear.from_linear(lin, scheme).weight)})
        except Exception as err:
            rows.append({"check": f"linear {scheme}", "gpu_path": "bf16 in/out", "error": repr(err)[:200]})
    return rows


def run(smoke: bool = False) -> dict:
    dev = device()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256 if smoke else 1024, 512 if smoke else 4096, generator=gen).to(torch.bfloat16).float()
    rows = quantize_rows(x, dev)
    rows += gemm_rows(16, 256, 512, dev) if smoke else gemm_rows(8, 4096, 4096, dev) + gemm_rows(512, 2048, 4096, dev)
    rows += linear_rows(16, 256, 512, dev) if smoke else linear_rows(64, 2048, 4096, dev)
    cols = ["check", "gpu_path", "q_identical", "scale_identical", "weights_identical", "sqnr_vs_cpu_emulation_db",
            "sqnr_vs_float64_db", "cpu_emulation_vs_float64_db", "error"]
    print(table(f"GPU ({dev}) vs CPU emulation agreement", rows, cols))
    payload = {"rows": rows}
    write_json("quant_agreement" + ("_smoke" if smoke else ""), payload)
    return payload


def bench(smoke: bool) -> dict:
    """Suite entry: how many GPU-vs-CPU-emulation checks ran and how many disagreed (or raised)."""
    rows = run(smoke)["rows"]
    flags = ("q_identical", "scale_identical", "weights_identical")
    bad = [r for r in rows if "error" in r or any(r.get(f) is False for f in flags)]
    sqnrs = [r["sqnr_vs_float64_db"] for r in rows if isinstance(r.get("sqnr_vs_float64_db"), (int, float))]
    return {"cases": len(rows), "disagreements": len(bad), "min_sqnr_vs_float64_db": min(sqnrs, default=float("nan"))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    run(parser.parse_args().smoke)
