"""Where the fused decode q/k-norm + RoPE + KV-write kernel and the torch reference (the HF op sequence)
part on CUDA: per case, the fraction of query values that differ, the largest difference in bf16 ulps, each
side's error against float64, and for an FP8 cache the K/V codes that differ (with the float32 value
they encode, to tell a rounding tie from a real difference).

    python benchmarks/gpu/diag_rope_numerics.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "lumenrl-backends" / "tests"))
from test_backends_engine_rope import float64_norm_rope, random_case  # noqa: E402

from lumenrl_backends.engines import triton_rope  # noqa: E402


def ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in units of the bf16 spacing at ref."""
    spacing = torch.ldexp(torch.ones_like(ref.float()), torch.frexp(ref.float().abs().clamp_min(1e-30))[1] - 8)
    return ((x.float() - ref.float()).abs() / spacing)


def main() -> None:
    for shape, norm, fp8 in [((64, 32, 8, 128), True, True), ((64, 32, 8, 128), False, True),
                             ((64, 32, 8, 128), True, False)]:
        case = random_case(*shape, norm=norm, fp8=fp8, length=300, device="cuda", seed=sum(shape))
        got, ref = case.args(), case.args()
        q = triton_rope.decode_qk_rope_kv_write(got[0], got[1], got[2], got[6], got[7], got[8], got[9], got[10],
                                                q_weight=got[3], k_weight=got[4], eps=got[5], k_scale=got[11],
                                                v_scale=got[12])
        q_ref = triton_rope.reference_decode_qk_rope_kv_write(*ref)[:, :, 0]
        q = q[:, :, 0]
        exact = float64_norm_rope(case.query, case.q_weight, case.eps, case.cos, case.sin)
        differ = q != q_ref
        u = ulps(q, q_ref)
        print(f"case {shape} norm={norm} fp8={fp8}: q differs {float(differ.float().mean()):.4f}, max {float(u.max()):.2f} "
              f"bf16 ulps; |err vs float64| mean kernel {float((q.double() - exact).abs().mean()):.3e} "
              f"reference {float((q_ref.double() - exact).abs().mean()):.3e}")
        if differ.any():
            idx = differ.nonzero()[:4]
            for i in idx.tolist():
                print("   at", i, "kernel", float(q[tuple(i)]), "reference", float(q_ref[tuple(i)]), "float64",
                      float(exact[tuple(i)]))
        rows = torch.arange(shape[0], device="cuda")
        for name, c, cr in (("K", got[8], ref[8]), ("V", got[9], ref[9])):
            a, b = c[rows, :, case.columns], cr[rows, :, case.columns]
            d = a.view(torch.uint8) != b.view(torch.uint8)
            print(f"   {name} cache values differ {float(d.float().mean()):.4f}")
            if d.any() and fp8:
                src, scale = case.value, case.v_scale
                if name == "K":
                    src = case.key if not norm else triton_rope.rms_norm(case.key, case.k_weight, case.eps)
                    src, scale = triton_rope.rope(src, case.cos, case.sin), case.k_scale
                for i in d.nonzero()[:4].tolist():
                    x = src[tuple(i)]
                    print("     code kernel", float(a[tuple(i)].float()), "reference", float(b[tuple(i)].float()),
                          "bf16 value", float(x), "x/scale float32", float(x.float() / scale.float()),
                          "float64", float(x.double() / scale.double()))


if __name__ == "__main__":
    main()
