"""Condense benchmarks/results/quant_*.json into the markdown tables of benchmarks/RESULTS.md.

    python benchmarks/quant/summarize.py [results_dir]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _fmt(v: object, nd: int = 3) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def _pivot(rows: list[dict], key: str, paths: list[str], value: str) -> list[str]:
    by: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault((r["M"], r["N"], r["K"]), {})[r[key]] = r
    lines = ["| M | N | K | " + " | ".join(paths) + " |", "|" + "---|" * (3 + len(paths))]
    for (m, n, k), d in sorted(by.items(), key=lambda t: (t[0][1], t[0][2], t[0][0])):
        cells = []
        for p in paths:
            r = d.get(p, {})
            if "error" in r:
                cells.append("n/a")
            elif p == paths[0]:
                cells.append(f"{_fmt(r.get(value))} us")
            else:
                cells.append(f"{_fmt(r.get(value))} us ({_fmt(r.get('speedup_vs_bf16'), 2)}x)")
        lines.append(f"| {m} | {n} | {k} | " + " | ".join(cells) + " |")
    return lines


def main(results: Path) -> None:
    q = json.loads((results / "quant_quantize.json").read_text())
    env = q["environment"]
    print(f"Hardware: {env['device']} (sm {env.get('sm')}, {env.get('sms')} SMs), torch {env['torch']}, "
          f"CUDA {env.get('cuda')}, triton {env.get('triton')}, date {env['date_utc']}\n")
    print(f"Measured device copy bandwidth: {q['copy_GBps']:.0f} GB/s (bf16, read + write).\n")
    print("| kernel | backend | ms | GB/s | % of copy | bit-identical to torch |\n|---|---|---|---|---|---|")
    for r in q["rows"]:
        if "error" in r:
            print(f"| {r['kernel']} | {r['backend']} | error: {r['error'][:80]} | | | |")
            continue
        pct = _fmt(r["pct_copy"])
        if r["kernel"] == "fp8_tensorwise":
            pct += f" ({_fmt(r.get('moved_pct_copy'))} counting both reads)"
        print(f"| {r['kernel']} | {r['backend']} | {_fmt(r['ms'])} | {_fmt(r['GB/s'])} | {pct} | "
              f"{_fmt(r.get('bit_identical_to_torch', ''))} |")
    g = json.loads((results / "quant_gemm.json").read_text())
    paths = ["bf16", "tensorwise", "rowwise", "blockwise", "triton_blockwise"]
    print("\nDecode-shaped GEMM, us per GEMM (CUDA-graph replay; speedup vs BF16):\n")
    print("\n".join(_pivot(g["decode"], "path", paths, "us")))
    print("\nTraining-shaped GEMM (TFLOP/s in the JSON), us per GEMM:\n")
    print("\n".join(_pivot(g["training"], "path", paths, "us")))
    print(f"\nTriton blockwise faster than cuBLAS blockwise at M: {g.get('triton_beats_cublas_at')}\n")
    lin = json.loads((results / "quant_linear.json").read_text())
    schemes = ["bf16", "fp8_block", "fp8_row", "fp8_tensor", "mxfp8", "mxfp4"]
    print("QuantizedLinear forward incl. activation quantization, us (decode: CUDA-graph replay):\n")
    print("\n".join(_pivot(lin["decode"] + lin["training"], "scheme", schemes, "us")))
    a = json.loads((results / "quant_agreement.json").read_text())
    print("\n| check | GPU path | q identical | scales identical | SQNR vs CPU emulation (dB) | SQNR vs float64 (dB) |"
          "\n|---|---|---|---|---|---|")
    for r in a["rows"]:
        print(f"| {r['check']} | {r['gpu_path']} | {_fmt(r.get('q_identical', r.get('weights_identical')))} | "
              f"{_fmt(r.get('scale_identical'))} | {_fmt(r.get('sqnr_vs_cpu_emulation_db'))} | "
              f"{_fmt(r.get('sqnr_vs_float64_db'))} |" + (f" error: {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)
