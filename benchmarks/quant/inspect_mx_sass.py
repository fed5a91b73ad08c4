"""Compile the MX quantize kernels for sm_90 on a machine without a GPU and count what matters.

Uses Triton's bundled ptxas / cuobjdump, with the specialization a real launch gets (16-byte
aligned pointers, strides and K divisible by 16). Per kernel: SASS instructions, shared-memory
stores and barriers (layout conversions), global load / store widths, registers. Pass
``BLOCK_M BLOCK_K NUM_WARPS`` (default 2 2048 8); files are written to ``--out`` (default /tmp).

    python benchmarks/quant/inspect_mx_sass.py [BLOCK_M BLOCK_K NUM_WARPS] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lumenrl_quant import triton_kernels as tk

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def inspect(name: str, fn, sig: dict, consts: dict, warps: int, out: str) -> dict:
    attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(sig.items()) if t != "constexpr" and a != "M"}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin = os.path.join(out, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    ops = [m.split()[-1].split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*", sass)]
    glob = Counter(re.findall(r"(?:ld|st)\.global[\.\w]*", k.asm["ptx"]))
    row = {"kernel": name, "sass": len(ops), "STS": ops.count("STS"), "BAR": ops.count("BAR"),
           "regs": (re.findall(r"REG:(\d+)", res) or ["?"])[0], "global": dict(glob),
           "top": Counter(ops).most_common(8)}
    print(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tile", nargs="*", type=int, default=[2, 2048, 8])
    parser.add_argument("--out", default="/tmp")
    args = parser.parse_args()
    bm, bk, warps = args.tile
    ints = {"M": "i32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}
    quant = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", **ints, **dict.fromkeys(
        ["EMAX", "ELEM_MAX", "FP4", "OUT", "BLOCK_M", "BLOCK_K", "PACK_SUM"], "constexpr")}
    for impl in ("split", "sum"):
        inspect(f"mxfp4_{impl}", tk._mx_quant_kernel, quant, {"EMAX": 2, "ELEM_MAX": 6.0, "FP4": True, "OUT": tk.tl.uint8,
                "BLOCK_M": bm, "BLOCK_K": bk, "PACK_SUM": impl == "sum"}, warps, args.out)
    inspect("mxfp8", tk._mx_quant_kernel, {**quant, "q_ptr": "*fp8e4nv"}, {"EMAX": 8, "ELEM_MAX": 448.0, "FP4": False,
            "OUT": tk.tl.float8e4nv, "BLOCK_M": bm, "BLOCK_K": bk, "PACK_SUM": False}, warps, args.out)
    words = {"w_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*u8", "M": "i32", "KW": "i32", "stride_wm": "i32",
             "stride_qm": "i32", "stride_sm": "i32", **dict.fromkeys(["EMAX", "FP16", "BLOCK_M", "BLOCK_W"], "constexpr")}
    for fp16 in (False, True):
        inspect(f"mxfp4_words_{'fp16' if fp16 else 'bf16'}", tk._mx_fp4_words_kernel, words,
                {"EMAX": 2, "FP16": fp16, "BLOCK_M": bm, "BLOCK_W": bk // 2}, warps, args.out)


if __name__ == "__main__":
    main()
