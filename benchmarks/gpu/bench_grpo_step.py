"""One full GRPO step with LumenRL's own components vs TRL's GRPOTrainer (recorded baseline).

LumenRL side: the ``rl`` trainer built from ``configs/grpo_dense_bf16.yaml`` exactly as
``lumenrl train`` builds it (plugin registry, ``native`` engine with CUDA graphs, FSDP2 actor on
one GPU in bf16 mixed precision), on a random-init Qwen3-0.6B-shaped model saved to a temporary
directory, 16 prompts x 8 generations x 256 new tokens (EOS ignored), no reference model (TRL's
default ``beta=0``), one optimizer step per rollout batch. As TRL does with one optimizer step per
generation batch (``num_iterations=1``: its loss takes ``old_per_token_logps`` as the update's own
log-probs, detached), the old log-probs come from the update's forward
(``algorithm.old_log_probs=reuse``), so neither side runs a separate log-prob pass. A step is rollout
+ reward + advantages + update + weight sync (``RLTrainer.train_step``). Step 1 warms up (graph
capture, kernels); the table reports the median of the timed steps and the phases. On CUDA (``--profile-steps``,
32 by default; 0: none) the trained engine's decode step at the rollout's shape (all rows, temperature 1) is then
profiled once (``_common.profile_engine``: kernels per step, time by kernel class, marginal times, idle): where
the rollout's latency-bound steps go.

TRL side: ``bench_grpo_trl.py`` run first in the same job (its ``grpo_trl.json`` in the output
directory is picked up), else the issue's recorded baseline, TRL 1.16 GRPOTrainer
(``use_vllm=False``) on the same H200, same shapes (0.6B, 16 x 8 x 256): 8.2 s per step, measured
with torch 2.11 and transformers 5.17 (the versions on the device machine).

    python benchmarks/gpu/bench_grpo_trl.py --steps 3 && python benchmarks/gpu/bench_grpo_step.py --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import benchmarks.gpu._common as C  # noqa: E402
from benchmarks.gpu.trace_gaps import gap_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRL_BASELINE_S = 8.2  # issue 5: TRL 1.16 GRPOTrainer, no vLLM, 0.6B shape, 16 x 8 x 256, this H200


def save_random_model(shape: str, path: Path, device: str) -> None:
    from transformers import AutoTokenizer

    from lumenrl_backends.models.builtin import resolve_model_path

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    C.random_model(shape, device=device, dtype=dtype).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("lumenrl:tiny-qwen3-arith"))
    tokenizer.save_pretrained(path)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The GRPO step's workload, shared with ``bench_grpo_trl.py`` so both sides do the same work."""
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def build_trainer(model_dir: Path, out_dir: Path, args):
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    overrides = [
        f"policy.model_name={model_dir}", "trainer.warm_start_sft_steps=0", f"trainer.output_dir={out_dir}",
        "trainer.cpu_threads=0", "eval.enabled=false", "logger.backends=[jsonl]",
        f"policy.rollout.n={args.generations}", f"dataset.train_batch_size={args.prompts}",
        f"policy.rollout.max_new_tokens={args.new}", "policy.rollout.ignore_eos=true",
        f"policy.rollout.max_batch_size={args.prompts * args.generations}",
        "algorithm.use_kl_loss=false", "policy.train.mini_batch_size=0", "algorithm.old_log_probs=reuse",
        f"policy.train.micro_batch_size={args.micro_batch}", f"num_training_steps={args.steps + 1 + int(getattr(args, 'trace_step', False))}",
        "policy.dtype=bfloat16" if args.device == "cuda" else "policy.dtype=float32",
        f"cluster.device={args.device.split(':')[0]}",  # the trainer picks cuda:LOCAL_RANK itself
    ] + args.override
    config = load_config(str(ROOT / "configs" / "grpo_dense_bf16.yaml"), overrides)
    plan = plan_run(config)
    return plan.trainer_cls.from_plan(plan), overrides


class GcPauses:
    """Python's garbage-collector pauses while active (``gc.callbacks``): a host stall that no profiler range
    names. ``take()`` returns and clears (collections, total ms, longest ms, full collections)."""

    def __init__(self) -> None:
        self._start, self._pauses = 0.0, []

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def take(self) -> dict[str, float]:
        ms = [p for _, p in self._pauses]
        out = {"collections": len(ms), "ms": round(sum(ms), 2), "max_ms": round(max(ms, default=0.0), 2),
               "full": sum(g == 2 for g, _ in self._pauses)}
        self._pauses.clear()
        return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--out", default="grpo_step.json")
    ap.add_argument("--profile-steps", type=int, default=32, help="CUDA: decode steps of the rollout profile (0: none)")
    ap.add_argument("--trace-step", action="store_true",
                    help="profile one more step (host + GPU): the GPU's idle time per phase, the largest gaps and their host work")
    ap.add_argument("--trace-stack", action="store_true",
                    help="--trace-step with Python frames recorded too: each gap's host path names the code it sat in")
    ap.add_argument("--cprofile-step", action="store_true",
                    help="run one more step under cProfile and print its host functions by own time (slow host code)")
    args = ap.parse_args(argv)
    args.trace_step = args.trace_step or args.trace_stack
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out_dir = Path(tmp) / "model", Path(tmp) / "run"
        save_random_model(args.shape, model_dir, args.device)
        trainer, overrides = build_trainer(model_dir, out_dir, args)
        result["overrides"] = overrides
        steps = []
        with GcPauses() as pauses:
            for step in range(1, args.steps + 2):
                start = time.perf_counter()
                metrics = trainer.train_step(step)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                phases = {k.removeprefix("timing/").removesuffix("_s"): v for k, v in metrics.items()
                          if k.startswith("timing/")}
                gc_step = pauses.take()
                steps.append({"step": step, "seconds": seconds, **phases,
                              "generated_tokens": metrics["perf/generated_tokens"], "gc": gc_step})
                print(f"step {step}: {seconds:.2f} s  phases {', '.join(f'{k} {v:.2f}' for k, v in phases.items())}  "
                      f"gc {gc_step['collections']} collections {gc_step['ms']} ms (full {gc_step['full']})")
                sys.stdout.flush()
        if args.trace_step:
            result["step_trace"] = trace_step(trainer, args.steps + 2, stack=args.trace_stack)
        if args.cprofile_step:
            result["host_profile"] = host_profile(trainer, args.steps + 2 + int(args.trace_step))
        if args.device == "cuda" and args.profile_steps > 0:
            result["profile"] = rollout_profile(trainer, args.prompts * args.generations, args.profile_steps)
            C.print_profile(result["profile"], "rollout decode step")
    timed = steps[1:]
    median = statistics.median(s["seconds"] for s in timed)
    trl_s, trl_source = TRL_BASELINE_S, "recorded baseline from issue 5 (TRL 1.16, no vLLM, same H200 and shapes); not rerun"
    measured = Path(os.environ.get("LUMENRL_BENCH_OUT") or C.RESULTS_DIR) / "grpo_trl.json"
    if measured.exists():  # bench_grpo_trl.py ran first in this job: the ratio is side by side
        trl_s = json.loads(measured.read_text())["median_step_s"]
        trl_source = f"measured in the same job: {measured.name}"
    not_phases = ("step", "seconds", "generated_tokens", "gc")
    phases = {k: statistics.median(s[k] for s in timed) for k in timed[-1] if k not in not_phases}
    result["gc"] = {"ms_per_step": statistics.median(s["gc"]["ms"] for s in timed),
                    "max_ms": max(s["gc"]["max_ms"] for s in timed),
                    "full_per_step": sum(s["gc"]["full"] for s in timed) / len(timed)}
    result.update(steps=steps, median_step_s=median, step_s_min=min(s["seconds"] for s in timed),
                  step_s_max=max(s["seconds"] for s in timed), phase_medians=phases, trl_step_s=trl_s,
                  trl_source=trl_source, speedup_vs_trl=trl_s / median)
    result["summary"] = {"grpo_step_speedup_vs_trl": {
        "value": trl_s / median, "lumenrl_step_s": median, "trl_step_s": trl_s,
        "trl_source": trl_source, "command": result["command"]}}
    C.write_json(args.out, result)
    rows = [{"system": "lumenrl (native + fsdp2)", "step_s": median, **{k: v for k, v in timed[-1].items() if k not in not_phases}},
            {"system": f"trl GRPOTrainer ({trl_source.split(':')[0]})", "step_s": trl_s}]
    C.print_table(rows, ["system", "step_s", *[k for k in timed[-1] if k not in not_phases]])
    print(f"speedup vs TRL: {trl_s / median:.2f}x")
    return result


def trace_step(trainer, step: int, stack: bool = False) -> dict:
    """One more training step under ``torch.profiler`` (host and, on CUDA, GPU activity): its wall seconds and
    :func:`~benchmarks.gpu.trace_gaps.idle_summary` (the GPU's idle time per phase, the largest gaps and their host work).
    Not a timed step: the profiler adds host overhead to every launch (``stack``: Python frames too, more so). A
    failure of the trace itself is recorded, not raised (the timed steps stand without it)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu.trace_gaps import export_trace, idle_summary

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities, with_stack=stack) as prof:
        start = time.perf_counter()
        trainer.train_step(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    tick = time.perf_counter()
    try:
        summary = {"wall_s": round(wall, 4), **idle_summary(export_trace(prof))}
    except Exception as err:  # noqa: BLE001 - a diagnostic
        return {"error": f"{type(err).__name__}: {err}"}
    summary["analysis_s"] = round(time.perf_counter() - tick, 1)
    print("traced step:", json.dumps(summary))
    return summary


def host_profile(trainer, step: int, top: int = 25) -> list[dict]:
    """One more training step under ``cProfile``: the ``top`` functions by own (host) time, torch operators
    included (each a builtin call), with their call counts. Not a timed step (the profiler slows every call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(trainer.train_step, step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_ms": round(own * 1e3, 3),
            "cum_ms": round(cum * 1e3, 3)} for (file, line, name), (_, calls, own, cum, _) in rows]
    print("host profile of one step (own ms, cumulative ms, calls, function):")
    for r in out:
        print(f"  {r['own_ms']:9.3f} {r['cum_ms']:9.3f} {r['calls']:7d}  {r['function']}")
    return out


def rollout_profile(trainer, rows: int, steps: int) -> dict:
    """The trainer's engine decoding ``rows`` short random prompts at temperature 1 (the rollout's shape and
    sampling mode), profiled over ``steps`` decode steps; an error is recorded, not raised (the step times
    stand without it)."""
    from lumenrl_core.data_proto import DataProto

    engine = trainer.parts.engine
    vocab = engine.model.config.vocab_size
    ids = torch.randint(10, vocab - 1, (rows, 6), generator=torch.Generator().manual_seed(0))
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    try:
        return C.profile_engine(engine, batch, {"temperature": 1.0, "ignore_eos": True, "seed": 0}, steps=steps)
    except Exception as err:  # noqa: BLE001 - a diagnostic: the step times do not depend on it
        return {"error": f"{type(err).__name__}: {err}"}


SMOKE_ARGS = ["--shape", "tiny", "--prompts", "2", "--generations", "2", "--new", "4", "--steps", "1", "--device", "cpu"]


def run(smoke: bool) -> dict:
    """Suite entry: median seconds of one GRPO step (0.6B, 16 prompts x 8, 256 new tokens; smoke: tiny on CPU), the
    lowest and highest timed step, and the median seconds of each phase (``phase/<name>_s``: rollout, update, weight
    sync, ...: where the step goes)."""
    result = main([*SMOKE_ARGS, "--micro-batch", "4", "--trace-step", "--out", "grpo_step_smoke.json"] if smoke else [
        "--micro-batch", "64", "--trace-step", "--override", "policy.rollout.compile=full",
        "--override", "policy.train.compile_layers=true"])
    phases = {f"phase/{name}_s": seconds for name, seconds in result["phase_medians"].items()}
    phases.update({f"gc/{k}": v for k, v in result["gc"].items()})  # the collector's pauses in the timed steps
    trace = result["step_trace"]
    traced = {} if "error" in trace else {
        "step_trace/idle_ms": trace["idle_ms"], "step_trace/busy_ms": trace["busy_ms"],
        **{f"step_trace/idle_ms/{phase or 'outside'}": ms for phase, ms in trace["idle_ms_by_phase"].items()},
        **{f"step_trace/busy_ms/{phase or 'outside'}": ms for phase, ms in trace["busy_ms_by_phase"].items()},
        **{f"step_trace/gap{i}": gap_text(g) for i, g in enumerate(trace["largest_gaps"][:3], 1)},
        **{f"step_trace/idle_host{i}": f"{ms:.2f} ms: {key}" for i, (key, ms) in
           enumerate(list(trace.get("idle_ms_by_host", {}).items())[:3], 1)}}
    return {"step_s": result["median_step_s"], "step_s_min": result["step_s_min"], "step_s_max": result["step_s_max"],
            **phases, **traced, **C.profile_numbers(result.get("profile"), "rollout_profile/")}


if __name__ == "__main__":
    main()
