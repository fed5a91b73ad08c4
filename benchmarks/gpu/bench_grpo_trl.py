"""TRL's GRPOTrainer (``use_vllm=False``) on the work of ``bench_grpo_step.py``, for the side-by-side ratio.

Same random-init Qwen3 shape and tokenizer, 16 prompts x 8 generations x 256 new tokens (EOS
never sampled: ``min_new_tokens``), no reference model (``beta=0``), one optimizer step per
generation batch, bf16 on GPU. Rewards are random per completion (GRPO needs non-zero
advantages to do real work; their values do not change the step's cost). A step is TRL's
training step (generation, log-probs, loss, backward, optimizer); the median of the steps after
the first is reported. TRL and ``datasets`` travel as wheels in ``.whl/trl`` (``benchmarks/gpu_env.sh`` installs them).

    python benchmarks/gpu/bench_grpo_trl.py --steps 3
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import benchmarks.gpu._common as C  # noqa: E402
from benchmarks.gpu.bench_grpo_step import SMOKE_ARGS, add_workload_args, save_random_model  # noqa: E402


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)
            print(f"trl step {len(self.seconds)}: {self.seconds[-1]:.2f} s")
            sys.stdout.flush()

    return StepTimer()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--out", default="grpo_trl.json")
    args = ap.parse_args(argv)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    result = {"command": C.command_line(), "env": {**C.environment(), "trl": trl.__version__}, "args": vars(args)}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_random_model(args.shape, model_dir, args.device)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.padding_side = "left"
        prompts = [f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" for _ in range(args.prompts * (args.steps + 1))]
        completions = args.prompts * args.generations
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=completions, gradient_accumulation_steps=1,
            num_generations=args.generations, max_completion_length=args.new, use_vllm=False, beta=0.0,
            learning_rate=1e-6, max_steps=args.steps + 1, logging_steps=1, report_to=[], save_strategy="no",
            bf16=args.device == "cuda", use_cpu=args.device == "cpu", temperature=1.0, seed=0,
            generation_kwargs={"min_new_tokens": args.new}, dataloader_num_workers=0,
        )
        timer = step_timer()
        trainer = GRPOTrainer(
            model=model, reward_funcs=lambda completions, **kw: [rng.random() for _ in completions], args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer, callbacks=[timer],
        )
        trainer.train()
    median = statistics.median(timer.seconds[1:])
    result.update(step_seconds=timer.seconds, median_step_s=median, trl_version=trl.__version__)
    result["summary"] = {"trl_grpo_step_s": {"value": median, "command": result["command"]}}
    C.write_json(args.out, result)
    C.print_table([{"system": f"trl {trl.__version__} GRPOTrainer", "step_s": median}], ["system", "step_s"])
    return result


def run(smoke: bool) -> dict:
    """Suite entry: the same GRPO workload through TRL's GRPOTrainer and LumenRL, side by side in one job.

    TRL is optional: without it a smoke run times the LumenRL side only (a full run needs it)."""
    from benchmarks.gpu import bench_grpo_step

    workload = SMOKE_ARGS if smoke else []
    lumenrl = bench_grpo_step.run(smoke)
    lumenrl_s = lumenrl["step_s"]
    # where LumenRL's step goes (phase medians, GPU idle per phase, the collector's pauses; CUDA: the rollout's
    # decode-step profile), its spread
    detail = {k: v for k, v in lumenrl.items() if k.startswith(("rollout_profile/", "phase/", "step_trace/", "gc/"))}
    detail.update(lumenrl_step_s_min=lumenrl["step_s_min"], lumenrl_step_s_max=lumenrl["step_s_max"])
    if smoke and importlib.util.find_spec("trl") is None:
        return {"lumenrl_step_s": lumenrl_s, "trl": "not installed", **detail}
    trl = main([*workload, "--out", "grpo_trl_smoke.json" if smoke else "grpo_trl.json"])
    trl_s, trl_steps = trl["median_step_s"], trl["step_seconds"][1:]
    return {"lumenrl_step_s": lumenrl_s, "trl_step_s": trl_s, "speedup": trl_s / lumenrl_s,
            "trl_step_s_min": min(trl_steps), "trl_step_s_max": max(trl_steps), **detail}


if __name__ == "__main__":
    main()
