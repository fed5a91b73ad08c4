"""Tensor (+ sequence) parallel training throughput: the FSDP2 x TP mesh of ``training/parallelize.py``.

Harness entry ``benchmarks.parallel.bench_tp:run`` (``fn(smoke) -> dict``). On every visible GPU
(nccl; world = device count, needs >= 2) one process per GPU builds a random-init Qwen3 model of
the 1.7B layer shape (hidden 2048, 16 heads, 8 KV heads, intermediate 6144; ``layers`` layers, bf16
weights), and for each tp in (1, 2, 4) dividing the world (dp_shard = world / tp) times a
forward (prefill) and a forward+backward training step on 8 x 1024 tokens per data-parallel rank
(median of 3 after 1 warm-up). Reported: tokens/s over the whole world and peak memory per GPU.
Decode: the ``native`` engine does not shard a model (assembly refuses
``policy.rollout.tensor_parallel_size > 1`` with it); TP decode belongs to the vllm/sglang adapters,
so no decode figure is produced here.

``smoke=True``: 2 gloo ranks on CPU, a tiny Qwen3 (hidden 64), tp in (1, 2); numbers meaningless,
proves the path runs.

    python -m benchmarks.parallel.bench_tp            # GPU (>= 2 GPUs), prints a table
    python -m benchmarks.parallel.bench_tp --smoke    # CPU
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

_GPU_SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, num_hidden_layers=4, max_position_embeddings=4096)
_CPU_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=128, num_hidden_layers=2, max_position_embeddings=256)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(model, tp: int, world: int, device, rows: int, seq: int, repeats: int) -> dict[str, float]:
    from lumenrl_backends.training.parallelize import MeshDims, build_mesh, parallelize

    par = parallelize(copy.deepcopy(model), build_mesh(MeshDims(world=world, tp=tp), device.type))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=gen).to(device)

    def forward():
        with torch.no_grad():
            par(input_ids=ids)

    def step():
        par(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd, train = _timed(forward, device, repeats), _timed(step, device, repeats)
    tokens = rows * seq * (world // tp)  # every TP group processes its own rows
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {f"tp{tp}_prefill_tok_s": tokens / fwd, f"tp{tp}_train_tok_s": tokens / train, f"tp{tp}_peak_gib": peak}


def _worker(rank: int, world: int, store: str, smoke: bool, out: str) -> None:
    import faulthandler

    from transformers import AutoConfig, AutoModelForCausalLM

    faulthandler.enable()  # a rank killed by a signal (an abort in C++) prints its Python stacks
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if smoke:
        torch.set_num_threads(1)  # the ranks share the machine's cores (CI: two)
    else:
        torch.cuda.set_device(device)
    # Rendezvous through a file in the run's temporary folder: no port is picked here and bound later by a
    # rank (another process can take it in between). A lost rank fails the others' collectives within 5
    # minutes, not torch's default 30.
    torch.distributed.init_process_group("gloo" if smoke else "nccl", init_method=f"file://{store}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(minutes=5),
                                         **({} if smoke else {"device_id": device}))
    try:
        torch.manual_seed(0)
        cfg = AutoConfig.for_model("qwen3", **(_CPU_SHAPE if smoke else _GPU_SHAPE), tie_word_embeddings=False)
        dtype = torch.float32 if smoke else torch.bfloat16
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
        rows, seq, repeats = (2, 16, 1) if smoke else (8, 1024, 3)
        result: dict[str, Any] = {"world": world, "shape": "tiny-cpu" if smoke else "qwen3-1.7b-4layers"}
        for tp in (1, 2, 4):
            if tp <= world and world % tp == 0:
                result.update(_measure(model, tp, world, device, rows, seq, repeats))
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(result, fh)
        torch.distributed.barrier()  # no rank tears the group down while another still uses it
    finally:
        torch.distributed.destroy_process_group()


def run(smoke: bool) -> dict[str, Any]:
    world = 2 if smoke else torch.cuda.device_count()
    if not smoke and world < 2:
        raise RuntimeError(f"bench_tp needs >= 2 GPUs; {world} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), smoke, out), nprocs=world, join=True)
        with open(out) as fh:
            return json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    result = run(parser.parse_args().smoke)
    for key, value in result.items():
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")


if __name__ == "__main__":
    main()
