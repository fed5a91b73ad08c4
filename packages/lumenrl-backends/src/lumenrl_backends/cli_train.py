"""``lumenrl train --config X [key=value ...]``: load, check and assemble a run, then train it.

Every user error (unknown key, wrong type, a combination the assembly policy refuses, a missing
plugin) is reported as ONE line on stderr with exit status 2, before any model loads: the
config is loaded and validated, then :func:`~lumenrl_core.assembly.plan_run` checks every
plugin and rule, and only then does the trainer build models.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["register_cli", "run_train", "plan_from_args", "one_line"]


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train from a YAML config (+ dotted overrides)")
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/grpo_dense_bf16.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.model_name=Qwen/Qwen3-8B")
    p.set_defaults(func=run_train)


def one_line(exc: BaseException) -> str:
    """An assembly error lists every violation on its own line; join them into one."""
    violations = getattr(exc, "violations", None)
    if violations:
        return f"run config rejected ({len(violations)} problem(s)): " + "; ".join(str(v) for v in violations)
    return " ".join(str(exc).split())


def plan_from_args(config: str | None, overrides: Sequence[str], *, start_rollouter_server: bool = False) -> Any:
    """Load + validate the config and plan the run (no model is loaded); raises CLIError.
    ``start_rollouter_server``: a run with a rollouter process starts its server (:mod:`lumenrl_backends.rollouter_server`)
    once the config is read, before planning imports torch and transformers."""
    from lumenrl_backends.cli import CLIError
    from lumenrl_core.assembly import AssemblyError, plan_run
    from lumenrl_core.config import ConfigError, load_config

    try:
        cfg = load_config(config, list(overrides))
    except ConfigError as exc:  # one line per problem
        raise CLIError(str(exc)) from None
    if start_rollouter_server:
        from lumenrl_backends.rollouter_server import prestart, uses_rollouter_process

        if uses_rollouter_process(cfg):  # its imports run while this process plans (imports) and builds
            prestart()
    try:
        return plan_run(cfg)
    except (ConfigError, AssemblyError, FileNotFoundError) as exc:
        raise CLIError(one_line(exc)) from None


def run_train(args: argparse.Namespace) -> int:
    plan = plan_from_args(args.config, args.overrides, start_rollouter_server=True)
    from lumenrl_backends.cli import CLIError
    from lumenrl_backends.training.distributed import release_process_group
    from lumenrl_backends.training.nonfinite import NonFiniteError

    trainer = plan.trainer_cls.from_plan(plan)
    try:
        trainer.fit()
    except NonFiniteError as exc:  # a streak of skipped steps, or non-finite weights at a save: one line
        raise CLIError(f"training stopped: {exc}") from None
    release_process_group()  # every rank ends fit together; the group the run made goes before exit
    return 0
