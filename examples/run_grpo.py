"""Train with GRPO (or any preset) through LumenRL's Python API.

    python examples/run_grpo.py --config configs/grpo_dense_bf16.yaml [key=value ...]

Out of the box this is the embedded demo (a tiny Qwen3-architecture model, warm-started by a
short SFT on bundled single-digit arithmetic, then GRPO on CPU in about two minutes); it prints
the reward and greedy-accuracy rise. On a GPU machine, point it at a real model and dataset:

    python examples/run_grpo.py --config configs/grpo_dense_bf16.yaml \
        policy.model_name=Qwen/Qwen3-8B trainer.warm_start_sft_steps=0 trainer.cpu_threads=0 \
        dataset.name=jsonl dataset.path=data/gsm8k_train.jsonl dataset.use_chat_template=true \
        policy.max_prompt_length=512 policy.rollout.max_new_tokens=1024

The same run from the shell: ``lumenrl train --config ... [key=value ...]``.
"""

from __future__ import annotations

import argparse
import sys

from lumenrl_core.assembly import AssemblyError, plan_run
from lumenrl_core.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_dense_bf16.yaml", help="preset YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. num_training_steps=30")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)  # typed + validated: bad keys fail here
        plan = plan_run(config)  # every plugin resolved and checked; nothing loaded yet
    except (ConfigError, AssemblyError, FileNotFoundError) as exc:
        print(f"run_grpo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    trainer = plan.trainer_cls.from_plan(plan)  # == lumenrl_core.assembly.assemble(config)
    summary = trainer.fit()
    from lumenrl_backends.training.distributed import release_process_group

    release_process_group()  # the process group the run made (torchrun ranks, or one rank) goes before exit
    before = summary["eval_before"].get("eval/accuracy")
    after = summary["eval_after"].get("eval/accuracy")
    if before is not None and after is not None:
        print(f"reward rise (greedy eval accuracy): {before:.3f} -> {after:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
