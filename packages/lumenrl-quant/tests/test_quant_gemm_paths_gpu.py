"""Every GEMM path the dispatcher picks on the GPU, at small and odd model shapes, against float64.

The engine's FP8 linears meet shapes far from the 8B ones the benchmarks time: hidden 256 gives
K / 128 = 2 scale blocks, fused q/k/v gives N = 512, k/v projections N = 128. A path that reads a
scale layout wrongly at such a shape is silently wrong (a rollout mismatch KL of 4 nats on a small
trained model, session 3), so each (M, N, K, scheme) is checked against a float64 product of the
same FP8 codes and scales: SQNR >= 40 dB (float32 accumulation gives ~60+ dB on bf16 output).
"""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_quant.fp8 import quantize_fp8
from lumenrl_quant.gemm import gemm_path, run_gemm_path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU (sm_89+)"
)

LAYOUTS = {"fp8_row": ("rowwise", None, "rowwise", None), "fp8_block": ("block", (1, 128), "block", (128, 128))}
SHAPES = [(128, 256), (512, 256), (256, 512), (1024, 256), (256, 1024), (384, 384), (6144, 4096)]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (out.double() - ref).norm().item()
    return math.inf if err == 0 else 20 * math.log10(ref.norm().item() / err)


@pytest.mark.parametrize("scheme", sorted(LAYOUTS))
def test_every_dispatched_path_matches_float64_at_small_shapes(scheme):
    ga, ba, gb, bb = LAYOUTS[scheme]
    gen = torch.Generator(device="cuda").manual_seed(11)
    bad = []
    for (n, k) in SHAPES:
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.05
        w_q, w_s = quantize_fp8(w, granularity=gb, block_size=bb)
        for m in (1, 4, 16, 32, 64, 300):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            a_q, a_s = quantize_fp8(x, granularity=ga, block_size=ba)
            path = gemm_path(a_q, a_s, w_q, w_s, a_block_size=ba, b_block_size=bb)
            ref = run_gemm_path("emulated", a_q, a_s, w_q, w_s, out_dtype=torch.float32, a_block_size=ba,
                                b_block_size=bb).double()
            out = run_gemm_path(path, a_q, a_s, w_q, w_s, a_block_size=ba, b_block_size=bb)
            db = _sqnr(ref, out)
            if not db >= 40.0:
                bad.append((m, n, k, path, round(db, 1)))
    assert not bad, f"{scheme}: paths below 40 dB (M, N, K, path, dB): {bad}"


def test_weight_only_gemm_matches_float64_on_the_gpu():
    from lumenrl_quant import triton_gemm as tg

    gen = torch.Generator(device="cuda").manual_seed(12)
    for n, k in ((6144, 4096), (512, 256)):
        w_q, w_s = quantize_fp8(torch.randn(n, k, generator=gen, device="cuda") * 0.05, granularity="rowwise")
        for m in (1, 64):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = x.double() @ (w_q.double() * w_s.double().reshape(-1, 1)).T
            for dot in (torch.bfloat16, torch.float16):
                for cfg in ({"block_k": 128}, {"block_k": 128, "split_k": 2}):
                    out = tg.fp8_weight_only_gemm(x, w_q, w_s, dot_dtype=dot, config=cfg)
                    assert _sqnr(ref, out) >= 40.0, (n, k, m, dot, cfg, _sqnr(ref, out))


def test_w8a16_linear_takes_the_triton_path_at_decode_and_matches_float64():
    from torch import nn

    from lumenrl_quant import QuantizedLinear

    torch.manual_seed(13)
    lin = nn.Linear(4096, 6144, bias=True).cuda()
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    q = QuantizedLinear.from_linear(lin, "fp8_w8a16")
    assert q.gemm_path_for(64) == "triton_w8a16" and q.gemm_path_for(256) == "triton_w8a16"
    assert q.gemm_path_for(300) == "dequantize"
    w = q.dequantized_weight(torch.float64)
    for m in (1, 64, 200, 300):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        ref = x.double() @ w.T + lin.bias.double()
        assert _sqnr(ref, q(x)) >= 40.0, m


def test_rowwise_gemm_with_pdl_equals_without_in_a_graph_and_under_compile():
    """``pdl=True`` (programmatic dependent launch, sm90+) changes when the kernel starts, not what it computes:
    a chain of dependent rowwise GEMMs (each quantizes the previous output) captured in a CUDA graph with PDL
    edges equals the plain launches bit for bit on fresh inputs, and so does the chain under
    ``torch.compile(fullgraph=True)`` with and without PDL (inductor's quantization may round differently from
    eager's, so compiled is compared with compiled)."""
    from lumenrl_quant import triton_gemm as tg

    if not tg.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    gen = torch.Generator(device="cuda").manual_seed(13)
    cfg = {"block_m": 64, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 4}
    weights = [quantize_fp8(torch.randn(4096, 4096, generator=gen, device="cuda") * 0.02, granularity="rowwise")
               for _ in range(6)]
    x = torch.randn(64, 4096, generator=gen, device="cuda").to(torch.bfloat16)

    def chain(pdl: bool, prefetch: int = tg.PDL_PREFETCH) -> torch.Tensor:
        h = x
        for w_q, w_s in weights:
            a_q, a_s = quantize_fp8(h, granularity="rowwise", backend="torch")
            h = tg.fp8_rowwise_gemm(a_q, a_s, w_q, w_s, config=cfg, pdl=pdl, prefetch=prefetch)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    compiled = torch.compile(chain, fullgraph=True, dynamic=False)
    previous = None
    for _ in range(3):
        x.copy_(torch.randn(64, 4096, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        plain = chain(False)
        assert torch.equal(captured, plain)
        assert torch.equal(chain(True, prefetch=4096), plain) and torch.equal(chain(True, prefetch=0), plain)
        assert torch.equal(compiled(True), compiled(False))
        assert previous is None or not torch.equal(plain, previous)  # the inputs did change
        previous = plain


def test_fp8_row_linear_with_tma_gives_the_same_bits_in_a_graph():
    """``QuantizedLinear.tma`` (the engine's ``KernelOptions.tma``): the rowwise decode GEMM copies its tiles with the
    tensor memory accelerator; the same bits as pointer loads, eager and replayed from a CUDA graph with PDL."""
    from torch import nn

    from lumenrl_quant import QuantizedLinear
    from lumenrl_quant import triton_gemm as tg

    if not tg.pdl_supported(torch.device("cuda")):
        pytest.skip("TMA and PDL need compute capability 9.0+")
    torch.manual_seed(17)
    lin = nn.Linear(4096, 6144, bias=False).cuda()
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    q = QuantizedLinear.from_linear(lin, "fp8_row")
    assert q.gemm_path_for(64) == "triton_rowwise"
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    q.pdl = True
    plain = q(x)
    q.tma = True
    assert torch.equal(q(x), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = q(x)
    x.copy_(torch.randn(64, 4096, device="cuda").to(torch.bfloat16))
    graph.replay()
    q.tma = False
    assert torch.equal(captured, q(x)) and not torch.equal(captured, plain)
    # under fullgraph compile the TMA launch runs in the opaque op; inductor's activation quantization may round
    # differently from eager's, so compiled is compared with compiled
    want = torch.compile(lambda t: q(t), fullgraph=True)(x)
    q.tma = True
    assert torch.equal(torch.compile(lambda t: q(t), fullgraph=True)(x), want)
