"""The FP8 rowwise GEMM as the GPU compiles it, checked on the CPU: Triton compiles it for sm90 (Hopper) here,
without a GPU, and its TTGIR shows whether both operands stay on the software pipeline.

At decode sizes the kernel is bandwidth-bound: it is fast only while its activation and weight tiles arrive by
asynchronous copies into the shared-memory stages of its launch parameters and feed FP8 ``wgmma``. An operand
the compiler cannot prove aligned silently becomes a synchronous load, one DRAM latency per K step, with the same
bits, so tests of values cannot see it; this one reads the compiled kernel.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs Triton compiling (not its interpreter)")

FP8 = ("a_ptr", "b_ptr", "a_desc", "b_desc")  # without TMA the launch passes the operands as the descriptors
POINTERS = {**dict.fromkeys(FP8, "*fp8e4nv"), "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
ALIGNED = (*POINTERS, "M", "N", "stride_am", "stride_bn", "stride_cm")  # as a decode launch specializes them


def compile_sm90(n: int, k: int) -> tuple[str, int, dict]:
    """(TTGIR, shared-memory bytes, launch parameters) of the rowwise kernel for an (N, K) FP8 weight at the
    engine's launch parameters (``gemm.TRITON_ROWWISE_CONFIGS``), as a PDL decode launch at M = 64 with
    per-token activation scales runs it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lumenrl_quant import gemm
    from lumenrl_quant.triton_gemm import PDL_PREFETCH, _rowwise_gemm_kernel

    fn = _rowwise_gemm_kernel
    cfg = dict(gemm.TRITON_ROWWISE_CONFIGS[(n, k)])
    constexprs = {"K_SPLIT": k, "BLOCK_M": cfg["block_m"], "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
                  "EPILOGUE": True, "WEIGHT_ONLY": False, "DOT_FP16": False, "A_GROUP": 0, "PDL": True,
                  "PREFETCH": PDL_PREFETCH, "TMA": False}
    signature = {name: POINTERS.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return kernel.asm["ttgir"], kernel.metadata.shared, cfg


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_both_operands_of_the_8b_fp8_decode_gemms_are_asynchronous_copies_into_the_stages(shape):
    ttgir, shared, cfg = compile_sm90(*shape)
    # the K loop waits on one copy token per operand (activation, weight): both in flight ahead of their use
    waits = [line for line in ttgir.splitlines() if "ttg.async_wait %" in line]
    assert waits and all(len(re.findall(r"%\w+", line.split("{")[0])) - 1 == 2 for line in waits), waits
    assert ttgir.count("ttg.async_copy_global_to_local") >= 2 * cfg["num_stages"]
    # the stages' buffers: num_stages x (activation tile + weight tile) of one byte per element
    assert shared >= cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"]
    assert re.search(r"ttng\.warp_group_dot .*f8E4M3FN", ttgir)  # FP8 wgmma, no conversion to 16 bits
