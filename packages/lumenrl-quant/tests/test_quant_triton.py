"""GPU-only: Triton quantize kernels bit-identical to the torch path; Triton/cuBLAS GEMMs vs emulation.

CPU counterparts: test_quant_fp8.py covers the torch quantize path and the emulated GEMM these
kernels are compared against.
"""

from __future__ import annotations

import pytest
import torch

from lumenrl_quant import dequantize_fp8, emulated_scaled_mm, gemm_path, quantize_fp8, quantize_mx, scaled_mm
from lumenrl_quant import triton_kernels as tk
from lumenrl_quant.error import sqnr_db

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tk.triton_available("cuda"), reason="needs a CUDA GPU and triton"),
]

CASES = [("tensorwise", None), ("rowwise", None), ("block", (1, 128)), ("block", (128, 128))]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity,block_size", CASES)
def test_triton_quantize_bit_identical_to_torch(granularity, block_size, dtype):
    x = torch.randn(384, 1024, device="cuda", dtype=torch.bfloat16) * 3
    x[5, :128] = 0  # an all-zero group
    tq, ts = quantize_fp8(x, dtype=dtype, granularity=granularity, block_size=block_size, backend="triton")
    rq, rs = quantize_fp8(x, dtype=dtype, granularity=granularity, block_size=block_size, backend="torch")
    assert ts.shape == rs.shape and torch.equal(ts, rs)
    assert torch.equal(tq.view(torch.uint8), rq.view(torch.uint8))
    assert sqnr_db(x.float(), dequantize_fp8(tq, ts, block_size=block_size)) >= 25.0


@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_triton_blockwise_gemm_matches_emulation(m):
    a = torch.randn(m, 1024, device="cuda")
    b = torch.randn(512, 1024, device="cuda") * 0.02
    aq, sa = quantize_fp8(a, granularity="block", block_size=(1, 128))
    bq, sb = quantize_fp8(b, granularity="block", block_size=(128, 128))
    out = tk.fp8_blockwise_gemm(aq, sa, bq, sb, out_dtype=torch.float32)
    ref = emulated_scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32)
    # Hopper FP8 tensor cores accumulate each 128-long K block with reduced precision (~1e-3
    # relative), so agreement is bounded by SQNR rather than elementwise closeness (cuBLAS: ~55 dB)
    assert sqnr_db(ref, out) >= 45.0
    assert sqnr_db(a.double() @ b.double().t(), out) >= 28.0
    if m < 4:
        assert gemm_path(aq, sa, bq, sb) == "triton_blockwise"


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "blockwise"])
def test_gpu_scaled_mm_agrees_with_emulation(mode):
    lay = {"tensorwise": ("tensorwise", None, None), "rowwise": ("rowwise", None, None),
           "blockwise": ("block", (1, 128), (128, 128))}[mode]
    a = torch.randn(64, 1024, device="cuda")
    b = torch.randn(512, 1024, device="cuda") * 0.02
    aq, sa = quantize_fp8(a, granularity=lay[0], block_size=lay[1])
    bq, sb = quantize_fp8(b, granularity=lay[0], block_size=lay[2])
    path = gemm_path(aq, sa, bq, sb)
    assert path != "emulated", path
    out = scaled_mm(aq, sa, bq, sb, out_dtype=torch.bfloat16)
    assert sqnr_db(emulated_scaled_mm(aq, sa, bq, sb, out_dtype=torch.float32), out.float()) >= 40.0


@pytest.mark.parametrize("elem_format", ["e4m3", "e5m2", "e2m1"])
def test_triton_mx_quantize_bit_identical_to_torch(elem_format):
    x = torch.randn(96, 512, device="cuda") * 4
    x[0, :32] = 0
    t = quantize_mx(x, elem_format, backend="triton")
    r = quantize_mx(x, elem_format, backend="torch")
    assert torch.equal(t.scale, r.scale)
    assert torch.equal(t.data.view(torch.uint8), r.data.view(torch.uint8))


@pytest.mark.parametrize("impl", ["words", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_mxfp4_16bit_inputs_bit_identical_to_torch(dtype, impl):
    x = (torch.randn(37, 1248) * torch.exp2(torch.randint(-12, 12, (37, 1248)).float())).to(dtype)
    x[0, :32], x[1, :32], x[2, :32] = 0, torch.finfo(dtype).tiny / 4, 7.0  # zero, subnormal, all-equal blocks
    x[3, :32:2], x[3, 1:32:2] = torch.finfo(dtype).max, -torch.finfo(dtype).max
    x[4, 5], x[4, 40] = float("inf"), float("-inf")  # inf blocks: scale 0xFF, inf -> code 7
    x = x.cuda()
    d, s = tk.mx_quantize(x, "e2m1", config={"impl": impl})
    r = quantize_mx(x, "e2m1", backend="torch")
    assert torch.equal(s, r.scale) and torch.equal(d, r.data)
    views = {  # 2-byte aligned only; non-contiguous; one row of an odd-width tensor (odd row stride)
        "odd offset": torch.empty(37 * 1248 + 1, dtype=dtype, device="cuda")[1:].view(37, 1248).copy_(x),
        "non-contiguous": torch.empty(37, 1280, dtype=dtype, device="cuda")[:, :1248].copy_(x),
        "one row, odd stride": torch.empty(1, 1249, dtype=dtype, device="cuda")[:, 1:].copy_(x[:1]),
    }
    for name, view in views.items():
        d, s = tk.mx_quantize(view, "e2m1", config={"impl": impl})
        rows = view.shape[0]
        assert torch.equal(s, r.scale[:rows]) and torch.equal(d, r.data[:rows]), name


@pytest.mark.parametrize("granularity,block_size", CASES)
def test_gpu_torch_quantize_matches_cpu_bit_for_bit(granularity, block_size):
    x = torch.randn(256, 512) * 2
    cpu = quantize_fp8(x, granularity=granularity, block_size=block_size, backend="torch")
    gpu = quantize_fp8(x.cuda(), granularity=granularity, block_size=block_size, backend="torch")
    assert torch.equal(gpu[1].cpu(), cpu[1])
    assert torch.equal(gpu[0].cpu().view(torch.uint8), cpu[0].view(torch.uint8))
