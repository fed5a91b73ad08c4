"""Building a run's parts from a :class:`~lumenrl_core.assembly.RunPlan`.

Plugins that read the run config are built with ``Cls.from_config``; pure-math plugins with the
plan's ``build_*`` helpers. Roles, each a worker group on the plan's controller (``local``: in
this process; ``ray``: Ray actors, see :mod:`.placement`): ``actor`` (always), ``ref`` (a frozen copy of the initial policy, only when a KL
term is used), ``critic`` (``critic.enabled``); then the rollout engine (its
own copy of the policy, synced after every update), the reward scorer, the train loader and the
greedy evaluator. Loggers are built after a resume point is known (see ``make_loggers``).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lumenrl_backends.models import is_builtin, resolve_model_path
from lumenrl_backends.trainers.data import EVAL_TASK_SEED, make_loader, split_records
from lumenrl_backends.trainers.evaluation import Evaluator
from lumenrl_backends.trainers.outputs import write_run_record
from lumenrl_backends.trainers.placement import local_roles, ray_roles
from lumenrl_backends.trainers.scoring import Scorer
from lumenrl_backends.training import distributed as dist_utils

__all__ = ["TrainerParts", "build_parts", "seed_everything", "needs_reference"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def needs_reference(cfg: Any) -> bool:
    return bool(cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)


class _NullBar:
    def update(self, n: int = 1) -> None: ...

    def set_postfix(self, **kwargs: Any) -> None: ...

    def close(self) -> None: ...


@dataclass(kw_only=True)
class TrainerParts:
    """Everything the loop drives, built once per run. ``actor`` / ``ref`` / ``critic`` are
    worker groups (``group.call(method, batch)`` goes through the run's controller)."""

    config: Any
    tokenizer: Any
    actor: Any
    engine: Any
    scorer: Scorer
    estimator: Any
    policy_loss: Any
    train_loader: Any
    sampling: dict[str, Any]
    ref: Any | None = None
    critic: Any | None = None
    correction: Any | None = None
    evaluator: Evaluator | None = None
    logger_classes: dict[str, type] = field(default_factory=dict)
    loggers: list[Any] = field(default_factory=list)
    is_main: bool = True  # rank 0: the only rank that logs, prints and writes run files
    sync: Callable[[int], dict[str, float]] | None = None  # actor weights -> rollout engine(s), as a version
    release_rollout: Callable[[], dict[str, float]] = field(default=lambda: {})  # colocated: free KV cache
    close: Callable[[], None] = field(default=lambda: None)  # stop worker processes (ray)
    placement: dict[str, Any] = field(default_factory=dict)  # where the roles run (run record)

    def make_loggers(self, resume_step: int | None) -> None:
        """Instantiate ``logger.backends``; a resumed jsonl log drops records after ``resume_step``."""
        self.loggers = []
        if not self.is_main:
            return
        for name, cls in self.logger_classes.items():
            if name == "jsonl":
                self.loggers.append(cls.from_config(self.config, resume_step=resume_step))
            else:
                self.loggers.append(cls.from_config(self.config))

    def announce(self, message: str) -> None:
        if not self.is_main:
            return
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)

    def progress(self, *, initial: int, total: int) -> Any:
        if not (self.config.logger.progress_bar and self.is_main):
            return _NullBar()
        from tqdm import tqdm

        return tqdm(initial=initial, total=total, desc="rl", unit="step", dynamic_ncols=True, file=sys.stderr)


def _policy_path(plan: Any, log: Callable[[str], None]) -> str:
    cfg = plan.config
    base = resolve_model_path(cfg.policy.model_name)
    if cfg.trainer.warm_start_sft_steps <= 0:
        return base
    if not is_builtin(cfg.policy.model_name):  # a real checkpoint already answers: RL starts from it
        log(f"warm start: skipped for {cfg.policy.model_name!r} (trainer.warm_start_sft_steps applies to "
            "built-in lumenrl: demo models)")
        return base
    from lumenrl_backends.sft import warm_start

    return warm_start(cfg, base, plan.training_backend_cls, log=log)


def _device(cfg: Any) -> torch.device:
    """``cluster.device`` resolved for this rank (``cuda:LOCAL_RANK`` under torchrun)."""
    return dist_utils.resolve_device(cfg.cluster.device)


def set_host_threads(cpu_threads: int, loaded_on: torch.device | None = None) -> None:
    """torch's intra-op threads in this process (``trainer.cpu_threads``): a positive value is set before the models
    load (``loaded_on`` None). 0 leaves torch's default on the CPU; once the models are loaded on an accelerator
    (``loaded_on``), it means one thread: the host then only launches work and keeps books on small tensors, where a
    pool gains nothing and, on a busy host, stalls every operator until its descheduled threads run (a few dozen
    small operators took 26 ms instead of 0.3 ms with both cores of a 2-core machine busy; decision 0023)."""
    if loaded_on is None and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    elif loaded_on is not None and cpu_threads == 0 and loaded_on.type != "cpu":
        torch.set_num_threads(1)


def _sampling(cfg: Any) -> dict[str, Any]:
    r = cfg.policy.rollout
    return {
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
        "stop_token_ids": list(r.stop_token_ids),
        "ignore_eos": r.ignore_eos,
    }


def _evaluator(cfg: Any, records: list[dict[str, Any]], tokenizer: Any, scorer: Scorer) -> Evaluator | None:
    if not cfg.eval.enabled or not records:
        return None
    loader = make_loader(cfg, records, tokenizer, batch_size=len(records), seed=EVAL_TASK_SEED, shuffle=False)
    return Evaluator(
        prompts=loader.next_batch(),
        scorer=scorer,
        temperature=cfg.eval.temperature,
        max_new_tokens=cfg.policy.rollout.max_new_tokens,
        seed=EVAL_TASK_SEED,
    )


def _silent(message: str) -> None:
    return None


def _quiet_transformers() -> None:
    """No per-load "Loading weights" bars: the run has its own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_parts(
    plan: Any, log: Callable[[str], None] = print, *, on_policy_path: Callable[[str], None] | None = None
) -> TrainerParts:
    """Load models and data for ``plan`` (seeded by ``plan.config.seed``); ``on_policy_path`` is called
    with the (warm-started) policy path before any role's model loads (a rollout engine built in another
    process starts there, overlapping this build)."""
    cfg = plan.config
    _quiet_transformers()
    set_host_threads(cfg.trainer.cpu_threads)
    dist_utils.ensure_process_group(_device(cfg))  # torchrun ranks, or a 1-rank group
    is_main = dist_utils.rank() == 0
    seed_everything(cfg.seed)
    if is_main:
        write_run_record(cfg.trainer.output_dir, cfg, plan.describe())
    model_path = _policy_path(plan, log if is_main else _silent)
    if on_policy_path is not None:
        on_policy_path(model_path)
    seed_everything(cfg.seed)
    roles = (ray_roles if cfg.controller.name == "ray" else local_roles)(plan, model_path)
    tokenizer = roles.tokenizer
    train_records, eval_records = split_records(cfg)
    r = cfg.policy.rollout
    scorer = Scorer(
        reward_fn=plan.build_reward(),
        tokenizer=tokenizer,
        max_response_length=r.max_new_tokens,
        overlong_buffer_len=cfg.algorithm.overlong_buffer_len,
        overlong_penalty_factor=cfg.algorithm.overlong_penalty_factor,
    )
    correction = plan.build_rollout_correction() if cfg.quantization.rollout_correction.enabled else None
    set_host_threads(cfg.trainer.cpu_threads, _device(cfg))
    return TrainerParts(
        config=cfg,
        tokenizer=tokenizer,
        actor=roles.actor,
        ref=roles.ref,
        critic=roles.critic,
        engine=roles.engine,
        sync=roles.sync,
        release_rollout=roles.release_rollout,
        close=roles.close,
        placement=roles.placement,
        scorer=scorer,
        estimator=plan.build_adv_estimator(),
        policy_loss=plan.build_policy_loss(),
        correction=correction,
        train_loader=make_loader(
            cfg,
            train_records,
            tokenizer,
            batch_size=cfg.dataset.train_batch_size,
            seed=cfg.seed,
            shuffle=cfg.dataset.shuffle,
        ),
        evaluator=_evaluator(cfg, eval_records, tokenizer, scorer),
        sampling=_sampling(cfg),
        logger_classes=dict(plan.logger_classes),
        is_main=is_main,
    )
