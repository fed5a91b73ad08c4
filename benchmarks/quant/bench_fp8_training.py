"""FP8 training linear vs BF16 nn.Linear: forward + backward time and numerics at training shapes.

For each shape (tokens M, in K, out N) and recipe (tensorwise / rowwise / blockwise, format
hybrid), times one forward + backward of ``Fp8TrainingLinear`` (weight cache warm, as within a
step with gradient accumulation) against ``nn.Linear`` in bf16, and reports SQNR of the output and
of dX / dW against a float32 reference. Speedup = bf16 time / FP8 time.

    python benchmarks/quant/bench_fp8_training.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device, sqnr, table, time_ms, write_json  # noqa: E402

from lumenrl_quant.training import Fp8TrainingConfig, Fp8TrainingLinear  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise")
SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 8192, 8192)]
SMOKE_SHAPES = [(256, 256, 512)]


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def call():
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(grad)

    return call


def _reference(weight: torch.Tensor, x: torch.Tensor, grad: torch.Tensor):
    xr = x.detach().float().requires_grad_(True)
    wr = weight.detach().float().requires_grad_(True)
    y = xr @ wr.t()
    y.backward(grad.float())
    return y.detach(), xr.grad, wr.grad


def _bench_shape(m: int, k: int, n: int, dev: torch.device) -> list[dict]:
    torch.manual_seed(0)
    bf16 = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ref_y, ref_dx, ref_dw = _reference(bf16.weight, x, grad)
    base_ms = time_ms(_fwd_bwd(bf16, x, grad), iters=10)
    flops = 6 * m * k * n
    rows = [{"shape": f"{m}x{k}x{n}", "recipe": "bf16", "ms": base_ms, "TFLOP/s": flops / base_ms / 1e9,
             "speedup": 1.0, "sqnr_y": sqnr(ref_y, bf16(x).detach())}]
    for recipe in RECIPES:
        cfg = Fp8TrainingConfig(recipe=recipe, fp8_format="hybrid")
        layer = Fp8TrainingLinear(k, n, bias=False, device=dev, dtype=torch.bfloat16, config=cfg)
        layer.load_state_dict(bf16.state_dict())
        ms = time_ms(_fwd_bwd(layer, x, grad), iters=10)
        x.grad = layer.weight.grad = None
        y = layer(x)
        y.backward(grad)
        rows.append({"shape": f"{m}x{k}x{n}", "recipe": recipe, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                     "speedup": base_ms / ms, "sqnr_y": sqnr(ref_y, y.detach()),
                     "sqnr_dx": sqnr(ref_dx, x.grad), "sqnr_dw": sqnr(ref_dw, layer.weight.grad)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny shape (CPU check of the script)")
    args = parser.parse_args()
    dev = device()
    rows = [r for shape in (SMOKE_SHAPES if args.smoke else SHAPES) for r in _bench_shape(*shape, dev)]
    cols = ["shape", "recipe", "ms", "TFLOP/s", "speedup", "sqnr_y", "sqnr_dx", "sqnr_dw"]
    print(table(f"FP8 training linear, forward + backward ({dev})", rows, cols))
    write_json("quant_fp8_training" + ("_smoke" if args.smoke else ""), {"rows": rows})


if __name__ == "__main__":
    main()
