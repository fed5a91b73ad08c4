"""Data-parallel rollout throughput vs the number of rollout processes (CPU).

R processes, each with its own native engine on the same tiny Qwen3 model, generate their shard of
one batch (the controller's ``dp_compute_proto`` split with per-row seeds, as
:class:`~lumenrl_backends.workers.rollout.GroupRollout` does); they start together on a barrier
and the batch's tokens over the slowest shard's wall time is the throughput. Reported per R, with
the speed-up over R=1 and its efficiency (speed-up / R).

    python -c "from benchmarks.scale.rollout_dp import run; print(run(False))"
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from typing import Any

__all__ = ["run"]


def _shard(model_dir: str, rank: int, world: int, rows: int, new_tokens: int, barrier: Any, out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from lumenrl_backends.controllers.dispatch import plan_dispatch
    from lumenrl_backends.engines import NativeEngine
    from lumenrl_backends.models import load_model_and_tokenizer
    from lumenrl_backends.workers.rollout import with_row_seeds
    from lumenrl_core.data_proto import DataProto

    model, tokenizer = load_model_and_tokenizer(model_dir, dtype="float32")
    engine = NativeEngine(model, tokenizer, max_batch_size=rows, max_seq_len=16 + new_tokens)
    enc = tokenizer([f"{i % 10}+{i % 7}=" for i in range(rows)], padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    shard = plan_dispatch("dp_compute_proto", (with_row_seeds(batch, 0),), {}, world).calls[rank].args[0]
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(shard[:2], params)  # warm-up
    barrier.wait()
    start = time.perf_counter()
    result = engine.generate(shard, params)
    out.put((rank, int(result.batch["response_mask"].sum()), time.perf_counter() - start))


def _throughput(model_dir: str, world: int, rows: int, new_tokens: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_shard, args=(model_dir, r, world, rows, new_tokens, barrier, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    tokens = sum(r[1] for r in results)
    return tokens / max(r[2] for r in results)


def run(smoke: bool) -> dict[str, Any]:
    """Rollout tokens/s with 1 and 2 processes; ``smoke``: a smaller batch.

    ``speedup_2proc`` (weak scaling, the data-parallel case): each process keeps ``rows`` rows, so the
    batch doubles with the ranks, as when every replica is kept full. ``speedup_2proc_same_batch``
    (strong scaling): one batch of ``rows`` split over the processes; on a tiny model a decode step
    costs about the same at half the rows, so this one shows per-step overhead, not capacity."""
    from lumenrl_backends.models import build_tiny_model

    rows, new_tokens = (16, 8) if smoke else (64, 32)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model("qwen3", tmp, seed=0))
        one = _throughput(model_dir, 1, rows, new_tokens)
        two = _throughput(model_dir, 2, 2 * rows, new_tokens)
        two_same = _throughput(model_dir, 2, rows, new_tokens)
    return {"rows": rows, "new_tokens": new_tokens, "tok_s_1proc": round(one, 1), "tok_s_2proc": round(two, 1),
            "speedup_2proc": round(two / one, 3), "efficiency_2proc": round(two / one / 2, 3),
            "speedup_2proc_same_batch": round(two_same / one, 3)}
