"""Where cuBLAS blockwise FP8 ``torch._scaled_mm`` (1x128 x 128x128 scales) is wrong, and whether
padding the scale tensors' leading dimension to a multiple of 4 fixes it.

Session 3 found the dispatched ``scaled_mm_blockwise`` path at -19 dB SQNR (garbage) for K = 256
on the H200 (torch 2.11, CUDA 13.0) while K = 4096 is exact. For each (M, N, K) this prints the
SQNR against a float64 product of the same codes and scales for the layout LumenRL passes (1x128
scales outer-dim-major, 128x128 scales as the transposed view of a contiguous (N/128, K/128)) and
for the same scales copied into buffers whose leading dimension is padded to a multiple of 4.

    python benchmarks/quant/diag_blockwise_scales.py
"""

from __future__ import annotations

import math

import torch

from lumenrl_quant.fp8 import quantize_fp8


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (out.double() - ref).norm().item()
    return math.inf if err == 0 else 20 * math.log10(ref.norm().item() / err)


def padded_t(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) values in a (C, pad4(R)) row-major buffer, returned as its (R, C) transposed view (ld = pad4(R))."""
    r, c = scale.shape
    buf = torch.zeros((c, -(-r // 4) * 4), dtype=torch.float32, device=scale.device)
    buf[:, :r] = scale.t()
    return buf[:, :r].t()


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    print(f"torch {torch.__version__}")
    print("M     N     K     kblk  default_db  padded_db")
    for k in (128, 256, 384, 512, 640, 768, 1024, 4096):
        for n in (128, 512):
            w = torch.randn(n, k, generator=gen, device="cuda") * 0.05
            w_q, w_s = quantize_fp8(w, granularity="block", block_size=(128, 128))
            for m in (32, 64, 300):
                x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
                a_q, a_s = quantize_fp8(x, granularity="block", block_size=(1, 128))
                ref = (a_q.double() * a_s.double().repeat_interleave(128, 1)[:, :k]) @ (
                    w_q.double() * w_s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).T
                cells = []
                for sa, sb in ((a_s.float().t().contiguous().t(), w_s.float().contiguous().t()),
                               (padded_t(a_s.float()), padded_t(w_s.float().t()))):
                    try:
                        out = torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                        cells.append(f"{sqnr(ref, out):10.1f}")
                    except Exception as err:  # noqa: BLE001
                        cells.append(f"{type(err).__name__[:10]:>10}")
                print(f"{m:<5} {n:<5} {k:<5} {k // 128:<5} {cells[0]}  {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
