"""The persistent GEMM-chain prototype (``benchmarks/gpu/persistent_chain.py``): the per-GEMM chain's bits in
Triton's interpreter, and the kernel Triton compiles for sm90 (on the CPU) keeps its operands on the pipeline."""

from __future__ import annotations

import re

import pytest
from benchmarks.quant._common import run_interpreted


def test_the_persistent_chain_equals_the_per_gemm_chain_in_the_interpreter():
    result = run_interpreted("benchmarks.gpu.persistent_chain:interpreted_check")
    assert result["equal"], result  # the same tiles and K order as the decode kernel: the same bits
    assert result["dataflow_equal"], result  # K in segments: the same steps in the same order
    assert max(k // s for k, s in zip((64, 64, 64, 256), result["segments"])) > 1  # some GEMM walked K in segments


def test_the_dataflow_chain_compiles_for_sm90_with_every_operand_on_the_pipeline():
    """The 8B chain with deep stages and flags, compiled for sm90 on the CPU: each K segment's loop keeps its
    operands as asynchronous copies, and each flag wait comes before its segment's first copies."""
    triton = pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    from benchmarks.gpu import persistent_chain as pc
    from benchmarks.gpu.bench_decode_linear import DEEP_STAGES

    fn = pc._chain_kernel
    pointers = ("x0", "wq", "wo", "wgu", "wd", "y1", "y2", "y3", "out")
    s1, s2, s3, s4 = DEEP_STAGES
    constexprs = dict(LAYERS=2, H=4096, QKV=6144, QW=4096, INTER=12288, BN1=64, BK1=128, S1=s1, BN2=32, BK2=128, S2=s2,
                      BN3=32, BK3=64, S3=s3, BN4=32, BK4=128, S4=s4, PREFETCH=512, LINE=64, EMULATED=False, FLOW=True,
                      SEG1=4096, SEG2=4096, SEG3=4096, SEG4=4096, MAXT=384, TRACE=False)
    signature = {name: "*bf16" if name in pointers else "*i32" if name in ("counter", "flags") else
                 "*i64" if name == "trace" else "constexpr" if name in constexprs else "i32" for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, "counter", "flags")}
    kernel = triton.compile(compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ttgir = kernel.asm["ttgir"]
    waits = [line for line in ttgir.splitlines() if "ttg.async_wait %" in line]
    # one wait per pipelined K loop: q/k/v (twice: layer 0 reads x0), o, gate/up (x, gate, up), down (its segments
    # are an outer loop around one pipelined loop)
    tokens = sorted(len(re.findall(r"%\w+", w.split("{")[0])) - 1 for w in waits)
    assert tokens == [2] * 4 + [3], tokens
    assert kernel.metadata.shared <= 227 * 1024  # one program per multiprocessor fits
    # every flag wait (a while loop) is followed by its segment's copies before the segment's loop
    parts = ttgir.split("scf.while")[1:]
    assert parts and all("ttg.async_copy_global_to_local" in part.split("scf.for")[0] for part in parts)
    # no register spills inside a K loop (the first dataflow kernel spilled there: 7.8 ms against 5.3 with barriers)
    spills = k_loop_spills(kernel.asm["cubin"])
    assert spills == 0, spills


def k_loop_spills(cubin: bytes) -> int:
    """Local-memory loads and stores (register spills) inside the innermost loops that issue ``HGMMA``s, from the
    SASS of ``cubin`` (Triton's bundled ``nvdisasm``)."""
    import pathlib
    import subprocess
    import tempfile

    import triton

    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("Triton ships no nvdisasm here")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, code, pending = {}, [], None
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            if pending:
                labels[pending], pending = int(m.group(1), 16), None
            code.append((int(m.group(1), 16), m.group(2)))
    loops = []  # (first, last) address of each backward branch's loop
    for at, text in code:
        if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)) and labels.get(m.group(1), at) < at:
            loops.append((labels[m.group(1)], at))
    k_loops = [lp for lp in loops if any(lp[0] <= at <= lp[1] and "HGMMA" in text for at, text in code)]
    inner = [lp for lp in k_loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in k_loops)]
    assert inner, "no HGMMA loop found in the SASS"
    return sum(1 for at, text in code if ("LDL" in text or "STL" in text) and any(a <= at <= b for a, b in inner))
