"""Megatron-Core vs FSDP2 training step on one GPU: step time, tokens/s and MFU.

Harness entry ``benchmarks.megatron.bench_megatron:run`` (``fn(smoke) -> dict``). Both backends run
``train_step`` (fp32 master weights, bf16 compute, fused AdamW, grad clipping, log-probs + entropy
of the response tokens, a policy-gradient loss) on the same random-initialized Qwen3-1.7B shape
(``benchmarks/gpu/bench_train.py``: 8 x 1024 tokens, 1 prompt + 1023 response tokens per row).
FSDP2 uses its one-rank fast path (``single_device="on"``); Megatron-Core is ``GPTModel`` with the
local layer spec and SDPA core attention under bf16 autocast (tp = pp = ep = 1). MFU = 6 x unique
params x tokens / step time / 989e12. Before timing, the two backends' log-probs on the same weights
are compared (``logprob_max_abs_diff``, bf16 compute). Goal: Megatron step time within 1.25x of FSDP2.

``smoke=True``: the tiny ``smoke`` shape on CPU in fp32, 2 x 64 tokens, 1 timed step (times meaningless;
the log-prob difference must be ~1e-6).

    python -m benchmarks.megatron.bench_megatron            # GPU: prints a table
    python -m benchmarks.megatron.bench_megatron --smoke    # CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import bench_train as BT  # noqa: E402

from lumenrl_backends.training.fsdp2 import FSDP2Backend  # noqa: E402
from lumenrl_backends.training.megatron import MegatronBackend  # noqa: E402
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _backend(name: str, shape: str, device: torch.device, micro: int):
    model = BT.build_model(shape, device)
    common = dict(role="actor", optim=OptimConfig(lr=1e-6), num_training_steps=100, device=device)
    if name == "fsdp2":
        train = PolicyTrainConfig(micro_batch_size=micro, single_device="on")
        return FSDP2Backend(model, train=train, **common)
    return MegatronBackend(model, train=PolicyTrainConfig(micro_batch_size=micro), **common)


def _time_steps(backend: Any, batch: Any, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        _sync()
        t0 = time.perf_counter()
        backend.train_step(batch, BT.pg_loss)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run(smoke: bool = False, steps: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    """Timed ``steps`` after ``warmup`` (defaults 4 and 2; smoke: 1 and 0, where not given)."""
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    shape, rows, seq = ("smoke", 2, 64) if smoke else ("1.7b", BT.ROWS, BT.SEQ)
    steps = steps if steps is not None else 1 if smoke else 4
    warmup = warmup if warmup is not None else 0 if smoke else 2
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: allowed steps >= 1, warmup >= 0")
    vocab = BT.SHAPES[shape][5]
    batch = BT.make_batch("full", vocab, rows, seq, device)
    out: dict[str, Any] = {"shape": shape, "tokens_per_step": rows * seq, "device": device.type}
    log_probs = {}
    for name in ("fsdp2", "megatron"):
        backend = _backend(name, shape, device, micro=rows)
        params = sum(t.numel() for _, t in backend.named_weights()) - (
            vocab * BT.SHAPES[shape][0] if BT.SHAPES[shape][6] else 0
        )
        log_probs[name] = backend.compute_log_probs(batch)[0].float().cpu()
        step = statistics.median(_time_steps(backend, batch, warmup, steps))
        out[f"{name}_step_s"] = round(step, 4)
        out[f"{name}_tokens_per_s"] = round(rows * seq / step, 1)
        if device.type == "cuda":  # MFU only against the GPU's bf16 peak (not reported on CPU)
            out[f"{name}_mfu"] = round(6 * params * rows * seq / step / BT.PEAK_FLOPS, 4)
            out[f"{name}_peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        del backend
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["logprob_max_abs_diff"] = float((log_probs["fsdp2"] - log_probs["megatron"]).abs().max())
    out["megatron_over_fsdp2_step"] = round(out["megatron_step_s"] / out["fsdp2_step_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; with --smoke: 1)")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: allowed 1 or more")
    result = run(smoke=args.smoke, steps=args.steps)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
