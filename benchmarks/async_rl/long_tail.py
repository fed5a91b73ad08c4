"""Async RL vs the synchronous trainer under long-tail response lengths.

Every prompt gets a response length drawn from a lognormal (median ``median`` tokens, capped at
8x the median): the run's arithmetic problems are written to a local jsonl dataset whose rows carry
their own ``max_new_tokens`` (a per-prompt response cap, read by the native engine), with
``ignore_eos`` so the lengths are exactly the drawn ones. Every mode, and a rollouter in its own
process (which builds its own data loader), reads the same file: the same lengths for the same
prompts. Same model, same
number of steps and samples per step for every mode; measured: wall time of ``fit()`` to N
steps (model loads excluded; no checkpoint or HF export at the end: not what is compared),
trained samples/s, and the reward curve (``reward/mean`` per step); ``{mode}/build_s`` is the
untimed set-up (plan, models, engine) per mode.

Two rates per mode: ``samples_per_s`` over the whole ``fit()`` (start-up included), and
``steady_samples_per_s`` over steps 2..N, the rate a long run sees. The steady rate does not count the
samples an async run already held (queued or in transit) when step 1 ended, since they were made during
step 1, so it is a lower bound. ``samples_per_s_incl_build`` also charges the build (``build_s``).
A rollouter process is spawned inside the build, as soon as the policy path is known, and imports,
loads the policy (and on a GPU of its own builds its engine) while the trainer builds its models; what is left of its start-up (and its first generate call,
CUDA graph captures included) falls inside ``fit()``, in ``first_step_s``. From the run's metrics (async
modes): ``rollouter_idle_ratio`` (the rollouter's idle time over the run), ``trainer_wait_s_per_step``
(the trainer's wait for samples, steps 2..N) and ``first_step_wait_s`` (step 1's), and for a rollouter
process ``rollouter_ready_s`` (spawn to ready for its start message), ``startup_overlap_s`` (the part of it before the
trainer's build ended), ``rollouter_boot_s`` (spawn to the child running: interpreter start and the imports of its entry
point: torch, transformers, lumenrl)
and ``rollouter_first_group_s`` (start message to its first finished group). The GPU goals: the steady
rate, and the whole ``fit()`` rate at 20 steps. A rollouter process is forked from the rollouter server
(a forkserver that imports torch, transformers and LumenRL once); the benchmark starts that server at its
own start, as ``lumenrl train`` does at the CLI's start, so its imports overlap this process's work
(``rollouter_forked`` = 1: the child was forked from it, its imports done). What the rollouter did with its busy
time: ``rollouter_calls_per_step``, ``rollouter_interrupts_per_step`` and ``rollouter_refills_per_step`` (generate
calls and interrupts per trained step), ``rollouter_prefill_share`` (its prefill seconds over its generate seconds),
``rollouter_tokens_per_s`` (tokens over generate seconds) and ``rollouter_shared_prefill_frac`` (the admitted rows
that copied another row's prefill: a group's prompt, the native engine's ``share_prefill``); of the prefill time,
``rollouter_prefill_eager_share`` (host seconds of prefills at their own shape, no CUDA graph, over the generate
seconds; ``rollouter_prefill_eager_per_step`` of them per step, ``rollouter_prefill_packed_per_step`` of those packed:
contexts back to back, no padding), ``rollouter_capture_share`` (CUDA graph
captures, decode and prefill) and ``rollouter_prefill_wait_share`` (the host's wait for the admitted rows' first
tokens: the GPU's prefill and whatever runs before it).

Every mode makes one optimizer step per step and runs with ``algorithm.old_log_probs=reuse``: the
synchronous trainer's old log-probs and the async trainer's proximal ones (the policy before its update)
are the update's own forward, as TRL's GRPO does with one iteration, so no mode spends a forward pass on
them (the records before 2026-12-07 ran a separate pass in every mode).

Modes: ``sync`` (trainer.name=rl) and the four async presets (on-policy, stream off-policy,
stale, partial rollout), ``partial_thread``, partial rollout with the rollouter a thread of the trainer's
process, and ``partial_keep``, partial rollout whose sequences interrupted by a weight update continue on their
cached keys and values (``async_training.resume_kv=keep``) instead of a prefill under the new weights. On the CPU
the rollouter shares the trainer's process and device (``weight_sync.method=inprocess``, a thread). On the GPU it is a process of its own on the same device
(``weight_sync.method=cuda_ipc``): two processes on one GPU take turns on it (time slices), and the H100 records
of 2026-12-07 show the trainer's reference and update phases taking up to twice as long beside a busy rollouter
process. ``partial_thread`` runs beside it: a rollouter thread whose engine has a CUDA stream of its own, so the
GPU can run its kernels alongside the trainer's, at the cost of sharing the GIL. The engine holds two steps of rows
(``max_batch_size`` = 2 x prompts x n: what the async modes keep in flight), not more.

GPU shape (one H200, the ``async_long_tail_gpu`` entry): 20 steps x 8 prompts x 8 samples,
median 32 tokens (cap 256), a random-init Qwen3-0.6B-shaped checkpoint (``--model``; the records before
2026-12-07 ran the demo's tiny model, on which both trainers are bound by the host and whose overlap bound sat at
the 2.0x goal: decision 0012), the modes (sync, partial, partial_thread, partial_keep) run three times in turn.
A run this short moves by tens of percent from one time to the next (the sync rate alone did: 169-256 samples/s on one
H100; a partial run whose long samples went stale and were dropped lost to sync), so the speed-ups are each
round's side-by-side ratio, reported as the median of the three with the lowest and highest beside it. What a full run costs besides the timed steps is per mode (engine
and two FSDP2 backends built, CUDA graphs captured per (batch bucket, KV length) key) and once
per process (Triton kernels compiled at their first shape): the cap sets the number of KV-length
keys (cap / 64 + 1) and the decode steps per call, rows x cap the prefill after each interrupt,
so halving both (from 16 prompts, median 64) cuts generation about fourfold. Before the timed
modes an untimed ``sync`` run of the same shape pays the process-wide compiles, and an untimed run of the first
async mode pays what its rollouter compiles at its own shapes (two steps of rows in the engine: decode buckets the
synchronous run never reaches) into the disk caches, so they are charged to no mode (on the CPU there are none:
no warm-up). Without the second warm-up the first rollouter of a run (``partial``'s first round) ran 25-40% below
that mode's other two rounds (steady samples/s, four H100 runs of 2026-12-07); the async modes after it mostly did not. A one-step or three-step warm-up left one-time costs in the
first round's timed sync steps, which flattered the async mode (decision 0012). A rollouter process loads those Triton kernels
from the same disk cache (it inherits the environment), but captures its own CUDA graphs. The CPU smoke of the GPU entry runs its rollouter
as a process too (``weight_sync.method=filesystem``, the CPU stand-in for ``cuda_ipc``).

    python -m benchmarks.async_rl.long_tail            # CPU, the smoke shapes
    python -m benchmarks.async_rl.long_tail --gpu      # one GPU: rollouter process and trainer share it
    python -m benchmarks.async_rl.long_tail --gpu --async-override weight_sync.method=inprocess
        # the same, the async rollouter a thread of the trainer's process
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODES = {
    "sync": "grpo_dense_bf16.yaml",
    "onpolicy": "grpo_async_onpolicy.yaml",
    "stream": "grpo_async_stream.yaml",
    "stale": "grpo_async_stale.yaml",
    "partial": "grpo_async_partial.yaml",
    "partial_thread": "grpo_async_partial.yaml",
    "partial_keep": "grpo_async_partial.yaml",
}
# a mode's own overrides, after the run's async overrides: partial rollout with the rollouter a thread of the
# trainer's process (its engine on a CUDA stream of its own), beside the rollouter process of `partial` on the GPU
# partial_keep: partial rollout whose interrupted sequences continue on the keys and values their old weights cached
# (async_training.resume_kv=keep, an in-flight weight update) instead of being prefilled again under the new ones
MODE_OVERRIDES = {"partial_thread": ("weight_sync.method=inprocess",), "partial_keep": ("async_training.resume_kv=keep",)}


# every mode: one optimizer step per step, so the old (sync) / proximal (async) log-probs come from the update's own
# forward, not a pass of their own (module docstring)
OLD_LOG_PROBS = "reuse"


def long_tail_lengths(rng: np.random.Generator, rows: int, median: int, sigma: float = 1.0) -> np.ndarray:
    """Lognormal lengths with the given median, clipped to [1, 8 * median]."""
    lengths = np.exp(np.log(median) + sigma * rng.standard_normal(rows))
    return np.clip(np.rint(lengths), 1, 8 * median).astype(np.int64)


def long_tail_dataset(path: Path, *, median: int, seed: int, num_examples: int = 2000) -> Path:
    """The arithmetic task's problems (the preset's, difficulty 1) as a jsonl dataset, each row with its
    drawn ``max_new_tokens``."""
    import json

    from lumenrl_core.data.tasks import ArithmeticTask

    records = ArithmeticTask(num_examples=num_examples, difficulty=1, seed=0).records()
    lengths = long_tail_lengths(np.random.default_rng(seed), len(records), median)
    with open(path, "w") as f:
        for record, length in zip(records, lengths):
            f.write(json.dumps({"prompt": record["prompt"], "answer": record["ground_truth"],
                                "max_new_tokens": int(length)}) + "\n")
    return path


def release_device_memory() -> None:
    """What a finished mode held goes back to the device: reference cycles collected, then the CUDA caching
    allocator's cached blocks freed. Without it a mode's engine sizes its KV cache from what the previous
    modes left free (``gpu_memory_utilization`` x free memory), and a rollouter process can run out."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_mode(mode: str, *, steps: int, prompts: int, n: int, median: int, out: Path, extra: tuple[str, ...]) -> dict:
    data = out.parent / f"long_tail_median{median}.jsonl"  # written once per run (bench), read by every mode
    if not data.exists():
        long_tail_dataset(data, median=median, seed=0)
    from lumenrl_backends.loggers import read_metrics
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    overrides = [f"trainer.output_dir={out}", "logger.progress_bar=false", "logger.backends=[jsonl]",
                 "eval.enabled=false", "checkpointing.enabled=false", "checkpointing.export_hf=false",
                 f"num_training_steps={steps}", f"dataset.train_batch_size={prompts}", f"policy.rollout.n={n}",
                 f"policy.rollout.max_new_tokens={8 * median}", "policy.rollout.ignore_eos=true",
                 f"policy.rollout.max_batch_size={2 * prompts * n}", "dataset.name=jsonl", f"dataset.path={data}",
                 f"algorithm.old_log_probs={OLD_LOG_PROBS}", *extra]
    start = time.perf_counter()
    plan = plan_run(load_config(REPO / "configs" / MODES[mode], overrides))
    try:
        trainer = plan.trainer_cls.from_plan(plan)
        build = time.perf_counter() - start
        start = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - start
    finally:  # the next mode (its rollouter process, or an engine sized from free memory) gets this one's memory
        trainer = plan = None
        release_device_memory()
    records = read_metrics(out)
    samples = steps * prompts * n
    # steady state: steps 2..N (past start-up, a rollouter process's included), not counting the samples an
    # async run already held (queued or in transit) when step 1 ended: those were made during start-up
    steady = sum(r["perf/step_s"] for r in records[1:])
    held = records[0].get("async/queue_depth", 0.0) + records[0].get("async/in_transit", 0.0)
    return {"wall_s": wall, "build_s": build, "samples_per_s": samples / wall,
            "samples_per_s_incl_build": samples / (build + wall), **run_metrics(records),
            "steady_samples_per_s": ((steps - 1) * prompts * n - held) / steady if steps > 1 else float("nan"),
            "first_step_s": records[0]["perf/step_s"], "phases": step_phases(records[1:]),
            "step_s": steady / (steps - 1) if steps > 1 else float("nan"),
            "reward": [round(r["reward/mean"], 4) for r in records],
            "staleness_max": max((r.get("async/staleness_max", 0.0) for r in records), default=0.0),
            "staleness_oldest_max": max((r.get("async/staleness_oldest_max", 0.0) for r in records), default=0.0),
            "response_length_mean": sum(r["response_length/mean"] for r in records) / len(records),
            "dropped_stale": records[-1].get("async/dropped_stale", 0.0),
            "partial_rollouts": records[-1].get("async/partial_rollouts_total", 0.0),
            "trainer_idle": records[-1].get("async/trainer_idle_ratio", float("nan"))}


def step_phases(records: list[dict]) -> dict[str, float]:
    """Where a step's time goes (steps 2..N, seconds per step): the mean per step of each ``timing/{phase}_s``
    (sync generates, then scores, computes reference and old log-probs and updates; an async trainer waits for
    its batch, scores it and does the same without generating; ``other`` is what no phase covers; a phase only
    some steps run, such as a weight sync every ``trigger_parameter_sync_step`` steps, counts 0 in the others).
    A run whose steps do not time their wait for samples gets ``wait`` from the running total
    ``async/trainer_wait_s``."""
    if not records:
        return {}
    phases = sorted({k[len("timing/"):-len("_s")] for r in records for k in r
                     if k.startswith("timing/") and k.endswith("_s")})
    out = {p: sum(r.get(f"timing/{p}_s", 0.0) for r in records) / len(records) for p in phases}
    if "wait" not in out and len(records) > 1 and "async/trainer_wait_s" in records[-1]:
        out["wait"] = (records[-1]["async/trainer_wait_s"] - records[0]["async/trainer_wait_s"]) / (len(records) - 1)
    return out


STARTUP = ("rollouter_ready_s", "startup_overlap_s", "rollouter_boot_s", "rollouter_first_group_s",
           "rollouter_spawn_lead_s", "rollouter_forked", "rollouter_attach_s", "rollouter_engine_s",
           "rollouter_graph_captures", "rollouter_graph_capture_s", "rollouter_graph_recorded")


def run_metrics(records: list[dict]) -> dict[str, float]:
    """What the async run's metrics say about waiting: the rollouter's idle ratio (last step), the trainer's
    wait for samples per step (steps 2..N; step 1's apart) and a rollouter process's start-up times."""
    last = records[-1]
    if "async/trainer_wait_s" not in last:
        return {}
    first_wait = records[0]["async/trainer_wait_s"]
    out = {"rollouter_idle_ratio": last["async/rollouter_idle_ratio"], "first_step_wait_s": first_wait,
           "trainer_wait_s_per_step": (last["async/trainer_wait_s"] - first_wait) / max(len(records) - 1, 1)}
    for key in STARTUP:
        if f"async/{key}" in last:
            out[key] = last[f"async/{key}"]
    # what the rollouter did with its busy time (whole run): generate calls and interrupts per trained step, the
    # share of its generate time spent in prefill, and its decode rate
    steps = max(len(records), 1)
    for key in ("calls", "interrupts", "refills"):
        name = "rollouter_calls_total" if key == "calls" else f"{key}_total"
        if f"async/{name}" in last:
            out[f"rollouter_{key}_per_step"] = round(last[f"async/{name}"] / steps, 3)
    busy = last.get("async/rollouter_busy_s_total", 0.0)
    if busy > 0:
        out["rollouter_prefill_share"] = round(last.get("async/rollouter_prefill_s_total", 0.0) / busy, 4)
        # of it: prefills at their own shape (no CUDA graph; host seconds) and graph captures (decode and prefill)
        out["rollouter_prefill_eager_share"] = round(last.get("async/rollouter_prefill_eager_s", 0.0) / busy, 4)
        out["rollouter_capture_share"] = round(last.get("async/rollouter_graph_capture_s", 0.0) / busy, 4)
        out["rollouter_prefill_wait_share"] = round(last.get("async/rollouter_prefill_wait_s", 0.0) / busy, 4)
    for key in ("prefill_eager", "prefill_packed"):
        if f"async/rollouter_{key}" in last:
            out[f"rollouter_{key}_per_step"] = round(last[f"async/rollouter_{key}"] / steps, 3)
    if "perf/rollout_tokens_per_s" in last:
        out["rollouter_tokens_per_s"] = round(last["perf/rollout_tokens_per_s"], 1)
    admitted = last.get("async/rollouter_prefill_rows", 0.0) + last.get("async/rollouter_shared_prefill_rows", 0.0)
    if admitted > 0:  # rows that took another row's prefill (a group's prompt, engines/native.py share_prefill)
        out["rollouter_shared_prefill_frac"] = round(last["async/rollouter_shared_prefill_rows"] / admitted, 4)
    return out


def bench(smoke: bool, *, gpu: bool = False, modes: tuple[str, ...] | None = None,
          shape_override: dict[str, int] | None = None, async_overrides: tuple[str, ...] = (),
          rounds: int | None = None, model: str | None = None, overrides: tuple[str, ...] = ()) -> dict:
    """``fn(smoke) -> dict``: samples/s and time to N steps per mode, and each speed-up vs sync. ``overrides``:
    config overrides for every mode, sync included (e.g. ``policy.train.compile_layers=true``: the same trainer on
    both sides; recorded as ``overrides``), after the shape's and before ``async_overrides``. ``rounds``
    (default: 3 for the full GPU run, else 1): the modes run that many times in turn (sync, partial, sync,
    partial, ...); see :func:`combine_rounds` for what is reported. ``model``: ``builtin`` (the demo's tiny
    model, warm-started on the task) or a random-init Qwen3 shape of ``benchmarks.gpu._common.SHAPES`` saved as a
    checkpoint (default: ``0.6b`` for the full GPU run, else ``builtin``)."""
    from benchmarks.gpu._common import SHAPES

    if gpu and not smoke:  # one H200 within ~300 s (module docstring)
        shape = {"steps": 20, "prompts": 8, "n": 8, "median": 32}
        extra: tuple[str, ...] = ("cluster.device=cuda",)
        async_overrides = async_overrides or ("weight_sync.method=cuda_ipc",)  # the rollouter: a process of its own
        model = model or "0.6b"
    elif smoke:
        shape, extra = {"steps": 2, "prompts": 4, "n": 4, "median": 4}, ()
        if gpu:  # the GPU entry's path: a rollouter process (filesystem: what the CPU has for cuda_ipc)
            async_overrides = async_overrides or ("weight_sync.method=filesystem",)
    else:
        shape, extra = {"steps": 6, "prompts": 8, "n": 4, "median": 8}, ()
    model = model or "builtin"
    if model != "builtin" and model not in SHAPES:
        raise ValueError(f"model={model!r}: allowed builtin or one of {', '.join(SHAPES)}")
    # the built-in model is warm-started on the task (GPU: 20 SFT steps, untimed); a random-init one is not: its
    # rewards carry no signal, its step costs are what is measured
    warm = 20 if gpu and not smoke and model == "builtin" else 0
    extra = (*extra, f"trainer.warm_start_sft_steps={warm}")
    shape.update(shape_override or {})
    rounds = (3 if gpu and not smoke else 1) if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: allowed >= 1")
    # GPU: the goal's pair and the rollouter thread beside it (time)
    modes = modes or (("sync", "partial", "partial_thread", "partial_keep") if smoke or gpu else tuple(MODES))
    if modes[0] != "sync":
        modes = ("sync", *[m for m in modes if m != "sync"])
    results: dict[str, Any] = {"shape": " ".join(f"{k}={v}" for k, v in shape.items()), "rounds": rounds,
                               "old_log_probs": OLD_LOG_PROBS, "model": model}
    if async_overrides:
        results["async_overrides"] = " ".join(async_overrides)
    if overrides:
        results["overrides"] = " ".join(overrides)
        extra = (*extra, *overrides)
    if not any("weight_sync.method=inprocess" in o for o in async_overrides) and (gpu or async_overrides):
        from lumenrl_backends.rollouter_server import prestart

        # as `lumenrl train` does at its start: the rollouter server imports while this process goes on
        results["rollouter_server"] = "forkserver" if prestart() else "spawn"
    start = time.perf_counter()
    per_round: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("LUMENRL_CACHE", str(Path(tmp) / "cache"))
        if model != "builtin":  # every mode loads the same checkpoint, as a user's run loads its model
            from benchmarks.gpu.bench_grpo_step import save_random_model

            save_random_model(model, Path(tmp) / "model", "cuda" if gpu and not smoke else "cpu")
            extra = (*extra, f"policy.model_name={Path(tmp) / 'model'}")
        if gpu and not smoke:  # compiles (Triton, CUDA context) charged to no mode: whole runs (module doc)
            first_async = next((m for m in modes if m != "sync"), None)
            for mode in ("sync", *([first_async] if first_async else [])):  # the rollouter's shapes, on disk
                more = () if mode == "sync" else (*async_overrides, *MODE_OVERRIDES.get(mode, ()))
                run_mode(mode, out=Path(tmp) / f"warmup_{mode}", extra=(*extra, *more), **shape)
            results["warmup_steps"] = shape["steps"]
            results["warmup_modes"] = " ".join(("sync", *([first_async] if first_async else [])))
        failed: dict[str, str] = {}
        for r in range(rounds):
            got: dict[str, dict] = {}
            for mode in (m for m in modes if m not in failed):
                more = async_overrides if mode != "sync" else ()  # e.g. weight_sync.method=cuda_ipc: a rollouter process
                more = (*more, *MODE_OVERRIDES.get(mode, ()))
                try:
                    got[mode] = run_mode(mode, out=Path(tmp) / f"{mode}{r}", extra=(*extra, *more), **shape)
                except Exception as err:  # noqa: BLE001 - an extra mode's failure is recorded; the goal's pair stands
                    if mode not in MODE_OVERRIDES:
                        raise
                    failed[mode] = f"{type(err).__name__}: {err}"[:300]
            per_round.append(got)
    modes = tuple(m for m in modes if m not in failed)
    results.update({f"{mode}/error": why for mode, why in failed.items()})
    results.update(combine_rounds([{m: got[m] for m in modes} for got in per_round], modes))
    results["total_s"] = round(time.perf_counter() - start, 1)
    return results


# reported name: run_mode's key, each the median over the rounds
ROLLOUTER_WORK = ("rollouter_calls_per_step", "rollouter_interrupts_per_step", "rollouter_refills_per_step",
                  "rollouter_prefill_share", "rollouter_tokens_per_s",
                  "rollouter_shared_prefill_frac", "rollouter_prefill_eager_share", "rollouter_capture_share",
                  "rollouter_prefill_eager_per_step", "rollouter_prefill_packed_per_step",
                  "rollouter_prefill_wait_share")  # run_metrics: the last round's
# run_mode keys also reported round by round (``{mode}/rounds_{key}``)
ROUND_DETAIL = ("trainer_wait_s_per_step", "rollouter_tokens_per_s", "rollouter_capture_share",
                "rollouter_graph_captures", "dropped_stale")
MEDIANS = {"samples_per_s": "samples_per_s", "steady_samples_per_s": "steady_samples_per_s",
           "samples_per_s_incl_build": "samples_per_s_incl_build", "first_step_s": "first_step_s",
           "time_to_n_steps_s": "wall_s", "build_s": "build_s"}


def combine_rounds(per_round: list[dict[str, dict]], modes: tuple[str, ...]) -> dict[str, Any]:
    """One result from rounds of :func:`run_mode` results ({mode: result} per round, sync first):

    * the speed-ups vs sync are taken within each round (side by side) and reported as their median over the
      rounds (``{mode}/speedup_vs_sync``, ``steady_...``, ``..._incl_build``), with the lowest and highest
      (``..._min``, ``..._max``);
    * rates and times: the median over the rounds;
    * ``dropped_stale``: the sum over the rounds (a drop in any round shows); ``staleness_max`` (the lag the
      bound applies to) and ``staleness_oldest_max`` (a trained sample's oldest token's): the highest of any round;
    * ``{mode}/rounds_steady_samples_per_s`` and ``{mode}/rounds_samples_per_s``: each round's rate in turn (a
      text), so a record shows whether a mode's rate moved between rounds; likewise each round's
      :data:`ROUND_DETAIL` figures and update phase (``rounds_step_update_actor_s``), to tell what a slow round
      did otherwise;
    * ``{mode}/step_{phase}_s``: the median over the rounds of the seconds per step (steps 2..N) of each phase
      (:func:`step_phases`); for a generating mode, ``{mode}/overlap_bound`` (:func:`overlap_bound`);
    * the rest (reward curve, lengths, the rollouter's start-up and wait figures): the last round's.
    """
    out: dict[str, Any] = {}
    last = per_round[-1]
    for mode in modes:
        runs = [got[mode] for got in per_round]
        for name, key in MEDIANS.items():
            out[f"{mode}/{name}"] = round(float(np.median([g[key] for g in runs])), 3)
        for name in ("steady_samples_per_s", "samples_per_s"):
            out[f"{mode}/rounds_{name}"] = " ".join(f"{g[name]:.1f}" for g in runs)
        for name in ROUND_DETAIL:  # what a slow round did otherwise, where every round has it
            if all(name in g for g in runs):
                out[f"{mode}/rounds_{name}"] = " ".join(f"{g[name]:.4g}" for g in runs)
        if all("update_actor" in g.get("phases", {}) for g in runs):
            out[f"{mode}/rounds_step_update_actor_s"] = " ".join(f"{g['phases']['update_actor']:.4g}" for g in runs)
        for phase in sorted(set().union(*(g.get("phases", {}) for g in runs))):
            values = [g["phases"][phase] for g in runs if phase in g.get("phases", {})]
            out[f"{mode}/step_{phase}_s"] = round(float(np.median(values)), 4)
        bounds = [overlap_bound(g) for g in runs if "step_s" in g and "generate" in g.get("phases", {})]
        if bounds:
            out[f"{mode}/overlap_bound"] = round(float(np.median(bounds)), 3)
        out[f"{mode}/dropped_stale"] = float(sum(g["dropped_stale"] for g in runs))
        g = last[mode]
        out[f"{mode}/reward_last"] = g["reward"][-1]
        out[f"{mode}/reward_curve"] = " ".join(f"{r:.3f}" for r in g["reward"])
        out[f"{mode}/staleness_max"] = max(g["staleness_max"] for g in runs)
        out[f"{mode}/staleness_oldest_max"] = max(g.get("staleness_oldest_max", 0.0) for g in runs)
        out[f"{mode}/response_length_mean"] = round(g["response_length_mean"], 2)
        out[f"{mode}/partial_rollouts"] = g["partial_rollouts"]
        for key in ("rollouter_idle_ratio", "trainer_wait_s_per_step", "first_step_wait_s", *STARTUP, *ROLLOUTER_WORK):
            if key in g:
                out[f"{mode}/{key}"] = round(g[key], 4)
    for mode in modes[1:]:
        for name, key in (("speedup_vs_sync", "samples_per_s"), ("steady_speedup_vs_sync", "steady_samples_per_s"),
                          ("speedup_incl_build_vs_sync", "samples_per_s_incl_build")):
            ratios = [got[mode][key] / got["sync"][key] for got in per_round]
            out[f"{mode}/{name}"] = round(float(np.median(ratios)), 3)
            out[f"{mode}/{name}_min"] = round(min(ratios), 3)
            out[f"{mode}/{name}_max"] = round(max(ratios), 3)
    return out


def overlap_bound(run: dict) -> float:
    """The most an async run of this shape on the same device could gain over a synchronous run in the steady
    state: the synchronous step time over its time outside generation (``step_s / (step_s - generate)``), that is,
    generation hidden entirely while the trainer's own work costs what it costs the synchronous trainer. Reported
    as ``sync/overlap_bound`` (the median over the rounds): a steady goal above it needs a faster trainer step,
    not more overlap."""
    rest = run["step_s"] - run["phases"]["generate"]
    return run["step_s"] / rest if rest > 0 else float("inf")


def bench_gpu(smoke: bool) -> dict:
    return bench(smoke, gpu=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--modes", default="", help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--rounds", type=int, default=None,
                        help="times the modes run in turn (default: 3 on the GPU, else 1); speed-ups: the median")
    parser.add_argument("--shape", default="", help="override the shape, e.g. steps=8,prompts=16,n=8,median=64")
    parser.add_argument("--model", default=None,
                        help="builtin (the demo's tiny model) or a random-init Qwen3 shape: tiny, 0.6b, 1.7b, 8b "
                             "(default: 0.6b with --gpu, else builtin)")
    parser.add_argument("--override", action="append", default=[],
                        help="a config override for every mode, sync included, e.g. policy.train.compile_layers=true")
    parser.add_argument("--async-override", action="append", default=[],
                        help="a config override for the async modes only, e.g. weight_sync.method=cuda_ipc")
    parser.add_argument("--out", default="", help="also write every figure of the result to this JSON file")
    args = parser.parse_args()
    shape = {k: int(v) for k, v in (item.split("=") for item in args.shape.split(",") if item)}
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: allowed >= 1")
    results = bench(args.smoke, gpu=args.gpu, modes=tuple(args.modes.split(",")) if args.modes else None,
                    shape_override=shape, async_overrides=tuple(args.async_override), rounds=args.rounds,
                    overrides=tuple(args.override),
                    model=args.model)
    print(f"{'mode':<10}{'samples/s':>12}{'time to N (s)':>15}{'speed-up':>10}{'steady x':>10}{'resp len':>10}"
          f"{'stale drop':>11}{'partial':>9}{'lag/oldest':>11}  reward curve")
    for mode in MODES:
        if f"{mode}/samples_per_s" in results:
            print(f"{mode:<10}{results[f'{mode}/samples_per_s']:>12.2f}{results[f'{mode}/time_to_n_steps_s']:>15.2f}"
                  f"{results.get(f'{mode}/speedup_vs_sync', 1.0):>10.2f}"
                  f"{results.get(f'{mode}/steady_speedup_vs_sync', 1.0):>10.2f}{results[f'{mode}/response_length_mean']:>10.1f}"
                  f"{results[f'{mode}/dropped_stale']:>11.0f}{results[f'{mode}/partial_rollouts']:>9.0f}"
                  f"{results[f'{mode}/staleness_max']:>7.0f}/{results[f'{mode}/staleness_oldest_max']:<3.0f}"
                  f"  {results[f'{mode}/reward_curve']}")
    print(f"{results['shape']} model={results['model']}; total {results['total_s']} s (warm-up and builds included)")
    work = [mode for mode in MODES if f"{mode}/rollouter_prefill_share" in results]
    if work:  # what each async mode's rollouter did with its time (the last round's run)
        columns = {"idle": "rollouter_idle_ratio", "wait/step": "trainer_wait_s_per_step", "tok/s": "rollouter_tokens_per_s",
                   "prefill": "rollouter_prefill_share", "eager": "rollouter_prefill_eager_share",
                   "packed/step": "rollouter_prefill_packed_per_step", "capture": "rollouter_capture_share",
                   "shared": "rollouter_shared_prefill_frac"}
        print(f"{'rollouter':<15}" + "".join(f"{name:>12}" for name in columns))
        for mode in work:
            print(f"{mode:<15}" + "".join(f"{results.get(f'{mode}/{key}', float('nan')):>12.3f}"
                                          for key in columns.values()))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
