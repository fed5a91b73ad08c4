"""The decode GEMM kernel as the GPU compiles it, checked on the CPU: Triton compiles it for sm90 (Hopper) here,
without a GPU, and its TTGIR shows whether both operands stay on the software pipeline.

The kernel is bandwidth-bound: it is fast only while its x and weight tiles arrive by asynchronous copies, several
K steps ahead, into the shared-memory stages its launch parameters name, and feed ``wgmma``. A load the compiler
cannot vectorize (an operand whose alignment it cannot prove, for example an address read from memory) silently
becomes a synchronous load, one DRAM latency per K step, at the same bits. Tests of values cannot see that; this
one reads the compiled kernel.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from lumenrl_backends.engines import triton_linear as tlin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or tlin.INTERPRETED,
    reason="needs Triton compiling (not its interpreter)")

POINTERS = ("x_ptr", "w_ptr", "b_ptr", "g_ptr", "r_ptr", "out_ptr", "part_ptr", "count_ptr")
INTS = ("M", "M_TILES", "HALF", "stride_xm", "stride_wn", "stride_rm", "stride_om")
ALIGNED = (*POINTERS, "HALF", "stride_xm", "stride_wn", "stride_rm", "stride_om")  # as a launch specializes them


def compile_sm90(n: int, k: int, swiglu: bool) -> tuple[str, int, dict]:
    """(TTGIR, shared-memory bytes, launch parameters) of the decode kernel for an (N, K) bf16 weight at its tuned
    launch parameters, as ``decode_linear(..., pdl=True)`` launches it at M = 64."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = tlin._decode_linear_kernel
    cfg = dict(tlin.TUNED[(n, k, swiglu)])
    constexprs = {"x_desc": None, "w_desc": None, "K": k, "BLOCK_M": 64, "BLOCK_N": cfg["block_n"],
                  "BLOCK_K": cfg["block_k"], "SPLIT": 1, "HAS_BIAS": False, "SWIGLU": swiglu, "NORM": False,
                  "RESIDUAL": False, "PDL": True, "PREFETCH": tlin.PDL_PREFETCH, "LINE": 64, "EMULATED": False,
                  "TMA": False}
    signature = {name: "*bf16" if name in POINTERS else "i32" if name in INTS else "fp32" if name == "eps"
                 else "constexpr" for name in fn.arg_names}
    assert set(constexprs) == {name for name, kind in signature.items() if kind == "constexpr"}, fn.arg_names
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return kernel.asm["ttgir"], kernel.metadata.shared, cfg


@pytest.mark.parametrize("shape", [(6144, 4096, False), (4096, 4096, False), (12288, 4096, True),
                                   (4096, 12288, False)], ids=["qkv", "o", "gate_up", "down"])
def test_every_operand_of_the_8b_decode_gemms_is_an_asynchronous_copy_into_the_stages(shape):
    ttgir, shared, cfg = compile_sm90(*shape)
    operands = 3 if shape[2] else 2  # x and the weight tile (SwiGLU: the gate and up tiles)
    # the K loop waits on one copy token per operand: every operand is in flight ahead of its use
    waits = [line for line in ttgir.splitlines() if "ttg.async_wait %" in line]
    assert waits and all(len(re.findall(r"%\w+", line.split("{")[0])) - 1 == operands for line in waits), waits
    # the prologue issues stages - 1 steps ahead, the loop one per step: every stage of every operand
    assert ttgir.count("ttg.async_copy_global_to_local") >= operands * cfg["num_stages"]
    # the stages' buffers: num_stages x (x tile + weight tiles) of bf16, as the launch parameters were chosen for
    stage_bytes = (64 + (operands - 1) * cfg["block_n"]) * cfg["block_k"] * 2
    assert shared >= cfg["num_stages"] * stage_bytes
    assert "ttng.warp_group_dot " in ttgir  # Hopper's wgmma
