"""GRPO step scaling over GPUs through the Ray controller (weak scaling: a fixed batch per GPU).

For W in 1, 2, 4, 8 (up to the GPUs present) the demo recipe runs with ``controller.name=ray``,
W colocated ranks (one Ray actor per GPU: FSDP2 over NCCL + a rollout replica each; data-parallel
rollout) on a random-init Qwen3-1.7B-shaped model, ``prompts_per_gpu * W`` prompts x 8
generations x 256 new tokens per step. One warm-up step, then the median step time of the timed
steps. Throughput = generated samples per second; scaling efficiency at W =
throughput(W) / (W * throughput(1)); the goal is >= 0.85 at W=8 (rollout + training).

GPU (one command, prints a table):
    python -c "from benchmarks.scale.grpo_scaling import main; main()"
``smoke`` (CPU): the harness with the built-in tiny model, W=1 on the local controller, 1 timed step; the
Ray controller's ranks are covered by the Ray trainer tests (``test_backends_ray_trainer.py``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["run", "main"]


def _step_times(world: int, *, model: str, prompts: int, new_tokens: int, steps: int, gpu: bool) -> list[float]:
    from lumenrl_backends.loggers import read_metrics
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"policy.model_name={model}", "trainer.warm_start_sft_steps=0", f"trainer.output_dir={out}",
            "eval.enabled=false", "logger.backends=[jsonl]", "logger.progress_bar=false",
            "checkpointing.export_hf=false", "algorithm.use_kl_loss=false", "policy.rollout.n=8",
            f"dataset.train_batch_size={prompts * world}", f"policy.rollout.max_new_tokens={new_tokens}",
            "policy.rollout.ignore_eos=true", f"policy.rollout.max_batch_size={prompts * 8}",
            f"num_training_steps={steps + 1}",
            *(("controller.name=ray", f"controller.ray.num_workers={world}", "controller.ray.num_gpus_per_worker=1")
               if gpu else ("controller.name=local",)),
            "policy.dtype=bfloat16" if gpu else "policy.dtype=float32",
            "cluster.device=cuda" if gpu else "cluster.device=cpu", "trainer.cpu_threads=0" if gpu else "trainer.cpu_threads=1",
        ]
        plan = plan_run(load_config(str(ROOT / "configs" / "grpo_dense_bf16.yaml"), overrides))
        plan.trainer_cls.from_plan(plan).fit()
        return [r["perf/step_s"] for r in read_metrics(out)][1:]


def run(smoke: bool) -> dict[str, Any]:
    import ray
    import torch

    gpu = torch.cuda.is_available() and not smoke
    worlds = [w for w in (1, 2, 4, 8) if w <= torch.cuda.device_count()] if gpu else [1]
    prompts, new_tokens, steps = (16, 256, 3) if gpu else (2, 8, 1)
    started = gpu and not ray.is_initialized()
    if started:
        # "local": a fresh instance even when another Ray runs on this machine
        ray.init(address="local", include_dashboard=False, **({} if gpu else {"num_cpus": 4}))
    tmp = tempfile.TemporaryDirectory()
    try:
        model = "lumenrl:tiny-qwen3-arith"
        if gpu:
            sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
            from bench_grpo_step import save_random_model

            model = str(Path(tmp.name) / "qwen3-1.7b")
            save_random_model("1.7b", Path(model), "cuda")
        result: dict[str, Any] = {"device": "cuda" if gpu else "cpu", "shape": "1.7b" if gpu else "tiny"}
        base = None
        for w in worlds:
            step_s = statistics.median(_step_times(w, model=model, prompts=prompts, new_tokens=new_tokens,
                                                   steps=steps, gpu=gpu))
            samples_s = prompts * w * 8 / step_s
            base = base or samples_s
            result[f"step_s_{w}"] = round(step_s, 3)
            result[f"samples_s_{w}"] = round(samples_s, 2)
            result[f"efficiency_{w}"] = round(samples_s / (w * base), 3)
        if gpu and 8 in worlds:
            result["goal_met_8gpu"] = "yes" if result["efficiency_8"] >= 0.85 else "no"
        return result
    finally:
        tmp.cleanup()
        if started:
            ray.shutdown()


def main() -> None:
    result = run(False)
    print(f"{'W':>3} {'step s':>8} {'samples/s':>10} {'efficiency':>10}")
    for w in (1, 2, 4, 8):
        if f"step_s_{w}" in result:
            print(f"{w:>3} {result[f'step_s_{w}']:>8} {result[f'samples_s_{w}']:>10} {result[f'efficiency_{w}']:>10}")
    print({k: v for k, v in result.items() if not k.startswith(("step_s", "samples_s", "efficiency"))})


if __name__ == "__main__":
    main()
