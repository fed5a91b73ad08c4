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
                      SEG1=4096, SEG2=4096, SEG3=4096, SEG4=4096, MAXT=384)
    signature = {name: "*bf16" if name in pointers else "*i32" if name in ("counter", "flags") else
                 "constexpr" if name in constexprs else "i32" for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, "counter", "flags")}
    kernel = triton.compile(compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ttgir = kernel.asm["ttgir"]
    waits = [line for line in ttgir.splitlines() if "ttg.async_wait %" in line]
    # one wait per pipelined K loop: q/k/v (twice: layer 0 reads x0), o, gate/up (x, gate, up), down's 3 segments
    tokens = sorted(len(re.findall(r"%\w+", w.split("{")[0])) - 1 for w in waits)
    assert tokens == [2] * 6 + [3], tokens
    assert kernel.metadata.shared <= 227 * 1024  # one program per multiprocessor fits
    # every flag wait (a while loop) is followed by its segment's copies before the segment's loop
    parts = ttgir.split("scf.while")[1:]
    assert parts and all("ttg.async_copy_global_to_local" in part.split("scf.for")[0] for part in parts)
