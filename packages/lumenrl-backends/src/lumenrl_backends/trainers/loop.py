"""``RLTrainer``: the synchronous RL loop (GRPO, DAPO, PPO) over the plugin seams.

One step (see docs: DESIGN.md "Data flow of one synchronous RL step")::

    prompts -> repeat n (uid per prompt) -> engine.generate -> reward (+ overlong shaping,
    dynamic-sampling refill) -> actor old_log_probs, ref_log_probs, critic values -> KL in
    reward -> advantages -> rollout correction -> critic update -> actor update -> weight sync
    -> metrics -> checkpoint

Everything it calls arrives through :func:`lumenrl_core.assembly.assemble`; building the parts
lives in :mod:`.build`, each phase in its own module. Seeded end to end: model init, data order
and the engine's sampling seeds derive from ``seed``, so a resumed run reproduces an
uninterrupted one step for step.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.trainers.build import TrainerParts, build_parts
from lumenrl_backends.trainers.checkpoint import CheckpointManager
from lumenrl_backends.trainers.metrics import (
    PhaseTimer,
    batch_metrics,
    moe_step_metrics,
    throughput_metrics,
    train_tokens,
)
from lumenrl_backends.trainers.outputs import write_summary
from lumenrl_backends.trainers.rollout import collect_rollouts
from lumenrl_backends.trainers.sddd_online import online_sddd
from lumenrl_backends.trainers.update import (
    actor_loss_fn,
    apply_kl_in_reward,
    apply_rollout_correction,
    compute_advantages,
    critic_loss_fn,
)
from lumenrl_core.algorithms import masked_mean
from lumenrl_core.data_proto import DataProto

__all__ = ["RLTrainer"]


class RLTrainer:
    """The ``rl`` trainer plugin: ``RLTrainer.from_plan(plan).fit()``."""

    capabilities = manifest.RL.capabilities

    def __init__(self, parts: TrainerParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.step = 0
        self.history: dict[str, list[float]] = {}
        self.eval_before: dict[str, float] = {}
        self.eval_after: dict[str, float] = {}
        self.checkpoints = CheckpointManager(
            root=Path(self.config.trainer.output_dir) / "checkpoints",
            keep_last=self.config.checkpointing.keep_last,
        )
        self.actor_loss = actor_loss_fn(parts.policy_loss, self.config.algorithm)
        self.critic_loss = critic_loss_fn(self.config.critic, self.config.algorithm.loss_agg_mode)

    @classmethod
    def probe(cls) -> str | None:
        return manifest.RL.unavailable_reason()

    @property
    def total_steps(self) -> int:
        """``num_training_steps``, capped at ``trainer.total_epochs`` passes over the data when set."""
        steps, epochs = self.config.num_training_steps, self.config.trainer.total_epochs
        if epochs > 0:
            steps = min(steps, epochs * len(self.parts.train_loader))
        return steps

    @classmethod
    def from_plan(cls, plan: Any) -> RLTrainer:
        """Build every component the plan resolved (models load here, never in ``plan_run``)."""
        return cls(build_parts(plan))

    # ------------------------------------------------------------------ one step

    def _score_and_generate(self, step: int):
        cfg, p = self.config, self.parts
        return collect_rollouts(
            next_prompts=p.train_loader.next_batch,
            engine=p.engine,
            score=p.scorer,
            sampling=p.sampling,
            n=cfg.policy.rollout.n,
            run_seed=cfg.seed,
            step=step,
            target_groups=cfg.dataset.train_batch_size,
            dynamic_sampling=cfg.algorithm.dynamic_sampling,
            max_num_gen_batches=cfg.algorithm.max_num_gen_batches,
        )

    def _compute_log_probs(self, batch: DataProto, timer: PhaseTimer) -> None:
        p = self.parts
        batch.meta_info["temperature"] = float(p.sampling["temperature"]) or 1.0  # the workers read it
        if self.config.algorithm.old_log_probs == "recompute":  # reuse: the update's forward gives them
            with timer("old_log_prob"):
                batch.union(p.actor.call("compute_log_prob", batch))
        if p.ref is not None:
            with timer("ref"):
                batch.union(p.ref.call("compute_ref_log_prob", batch))
        if p.critic is not None:
            with timer("values"):
                batch.union(p.critic.call("compute_values", batch))

    def _update(self, batch: DataProto, timer: PhaseTimer) -> dict[str, float]:
        p, metrics = self.parts, {}
        with timer("prepare"):
            metrics.update(apply_kl_in_reward(batch, self.config.algorithm))
            metrics.update(compute_advantages(batch, p.estimator))
            metrics.update(apply_rollout_correction(batch, p.correction))
        if p.critic is not None:
            with timer("update_critic"):
                metrics.update(p.critic.call("update_critic", batch, self.critic_loss))
        with timer("update_actor"):
            metrics.update(p.actor.call("update_actor", batch, self.actor_loss))
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Run RL step ``step`` (1-based) and return its metrics."""
        timer, cfg = PhaseTimer(), self.config
        rollout = self._score_and_generate(step)
        timer.add("generate", rollout.generate_s)
        timer.add("score", rollout.score_s)
        # data-parallel rollout: every rank / the driver holds the whole gathered batch
        batch = _trim_to_mini_batches(rollout.batch, cfg)
        metrics = dict(rollout.metrics)
        with timer("release"):
            metrics.update(self.parts.release_rollout())  # colocated: the engines' KV cache freed for training
        if len(batch):
            with timer("prepare"):
                metrics.update(batch_metrics(batch, cfg.policy.rollout.max_new_tokens))
            self._compute_log_probs(batch, timer)
            metrics.update(_mismatch_metrics(batch))
            check_exact(metrics, cfg.policy.rollout, step)
            metrics.update(self._update(batch, timer))
            metrics.update(self._sync(step))
            metrics.update(online_sddd(self.parts.engine, batch, cfg.policy.rollout.speculative))  # no draft: {}
        else:
            metrics["batch/skipped"] = 1.0
        metrics.setdefault("actor/kl", math.nan)  # no reference model: KL not measured
        metrics.update(timer.metrics(metrics))
        metrics.update(
            throughput_metrics(
                generated_tokens=rollout.generated_tokens,
                generate_s=rollout.generate_s,
                train_tokens=train_tokens(batch, cfg.policy.train.ppo_epochs) if len(batch) else 0,
                train_s=timer.seconds.get("update_actor", 0.0),
                step_s=timer.elapsed(),
            )
        )
        return metrics

    # ------------------------------------------------------------------ the run

    def _resume(self) -> None:
        latest = self.checkpoints.latest() if self.config.checkpointing.resume else None
        if latest is None:
            return
        trainer_state, loader_state = CheckpointManager.load(latest, backends=self._backends())
        self.parts.train_loader.load_state_dict(loader_state)
        self.step = int(trainer_state["step"])
        self.parts.announce(f"resumed from step {self.step} of {self.total_steps}: checkpoint {latest}")
        self.eval_before = dict(trainer_state.get("eval_before", {}))
        self.eval_after = dict(trainer_state.get("eval_after", {}))
        self.history = {k: list(v) for k, v in trainer_state.get("history", {}).items()}
        self._sync(self.step)

    def _sync(self, version: int) -> dict[str, float]:
        return self.parts.sync(version)  # in process, per colocated rank, or over the weight channel

    def _backends(self) -> dict[str, Any]:
        roles = {"actor": _GroupCheckpoint(self.parts.actor)}
        if self.parts.critic is not None:
            roles["critic"] = _GroupCheckpoint(self.parts.critic)
        return roles

    def _save(self, step: int) -> None:
        self.checkpoints.save(
            step,
            backends=self._backends(),
            dataloader_state=self.parts.train_loader.state_dict(),
            trainer_state=self._trainer_state(),
        )

    def _trainer_state(self) -> dict[str, Any]:
        """What a resumed run needs besides weights and data order (the final evaluation included:
        a run killed during its final export restarts straight into the export)."""
        return {"eval_before": self.eval_before, "eval_after": self.eval_after, "history": self.history}

    def _evaluate(self) -> dict[str, float]:
        return self.parts.evaluator(self.parts.engine) if self.parts.evaluator is not None else {}

    def _should_eval(self, step: int) -> bool:
        every = self.config.eval.every or self.config.trainer.test_freq
        last = step == self.total_steps
        return self.parts.evaluator is not None and (last or (every > 0 and step % every == 0))

    def _record(self, metrics: Mapping[str, float], step: int) -> None:
        for key in ("reward/mean", "eval/accuracy", "actor/logprob_max_abs_diff"):
            if key in metrics:
                self.history.setdefault(key, []).append(float(metrics[key]))
        for logger in self.parts.loggers:
            logger.log(metrics, step)

    def fit(self) -> dict[str, Any]:
        """Train ``total_steps`` steps (resuming when configured); return the summary."""
        cfg = self.config
        self._resume()
        self.parts.make_loggers(resume_step=self.step if self.step > 0 else None)  # > 0: resumed
        if self.step == 0 and self.parts.evaluator is not None:
            self.eval_before = self._evaluate()
            self.parts.announce(f"eval before training: {_fmt_eval(self.eval_before)}")
            for logger in self.parts.loggers:  # step 0: the starting point of the eval curves
                logger.log(self.eval_before, 0)
        bar = self.parts.progress(initial=self.step, total=self.total_steps)
        try:
            for step in range(self.step + 1, self.total_steps + 1):
                metrics = self.train_step(step)
                if self._should_eval(step):
                    self.eval_after = self._evaluate()
                    metrics.update(self.eval_after)
                self._record(metrics, step)
                self.step = step
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', math.nan):.3f}")
                if _due(cfg.checkpointing, step, self.total_steps):
                    self._save(step)
            return self._finish()
        finally:
            bar.close()
            for logger in self.parts.loggers:
                logger.close()
            self.parts.close()  # ray: the worker actors stop with the run

    def _finish(self) -> dict[str, Any]:
        cfg, out = self.config, Path(self.config.trainer.output_dir)
        rewards = self.history.get("reward/mean", [])
        summary = {
            "steps": self.step,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "reward_first_k_mean": _mean(rewards[:3]),
            "reward_last_k_mean": _mean(rewards[-3:]),
            "eval_before": self.eval_before,
            "eval_after": self.eval_after,
            "output_dir": str(out),
        }
        if self.parts.is_main:  # before the export: a kill during it keeps the final evaluation
            write_summary(out, summary)
        if cfg.checkpointing.export_hf:  # staged, then renamed: final/ is whole or the previous one
            staging = out / ".final.staging"
            if self.parts.is_main:  # what a killed export left
                shutil.rmtree(staging, ignore_errors=True)
            self.parts.actor.call("save_hf", str(staging), tokenizer=self.parts.tokenizer)
            if self.parts.is_main:
                shutil.rmtree(out / "final", ignore_errors=True)
                os.replace(staging, out / "final")
        self.parts.announce(_fmt_summary(summary))
        return summary


def _mismatch_metrics(batch: DataProto) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same weights (mean |delta|)."""
    if "rollout_log_probs" not in batch.batch or "old_log_probs" not in batch.batch:
        return {}  # algorithm.old_log_probs=reuse: the actor loss reports the mean difference
    mask = batch.batch["response_mask"]
    delta = (batch.batch["old_log_probs"].float() - batch.batch["rollout_log_probs"].float()).abs()
    worst = (delta * mask).max().item() if mask.any() else 0.0
    out = {
        "rollout/logprob_abs_diff_mean": masked_mean(delta, mask).item(),
        "rollout/logprob_abs_diff_max": worst,
        "actor/logprob_max_abs_diff": worst,  # 0 exactly under policy.rollout.exact_logprobs
    }
    if "routed_experts" in batch.batch:  # R3 on: training/inference routing metrics (moe/*)
        out.update(moe_step_metrics(batch))
    return out


def check_exact(metrics: dict[str, float], rollout: Any, step: int) -> None:
    """``policy.rollout.exact_logprobs_check``: a nonzero difference in exact mode raises or warns."""
    diff = metrics.get("actor/logprob_max_abs_diff")
    if not rollout.exact_logprobs or diff is None or diff == 0.0 or rollout.exact_logprobs_check == "off":
        return
    message = (f"step {step}: policy.rollout.exact_logprobs is on but rollout and training log-probs differ "
               f"(max |delta| = {diff:.3e}); the engine and the trainer did not run the same kernels")
    if rollout.exact_logprobs_check == "error":
        raise RuntimeError(message)
    warnings.warn(message, stacklevel=2)


class _GroupCheckpoint:
    """A worker group seen as one checkpointable backend (the call runs on every rank)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def save_checkpoint(self, path: str) -> None:
        self.group.call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call("load_checkpoint", path)


def _trim_to_mini_batches(batch: DataProto, cfg: Any) -> DataProto:
    """Cut a (dynamic-sampling) batch to a whole number of mini-batches of whole groups."""
    mini = cfg.policy.train.mini_batch_size
    if not mini or len(batch) % mini == 0:
        return batch
    unit = math.lcm(mini, cfg.policy.rollout.n)
    return batch[: len(batch) - len(batch) % unit]


def _due(ckpt: Any, step: int, last: int) -> bool:
    if not ckpt.enabled:
        return False
    return step == last or (ckpt.save_every > 0 and step % ckpt.save_every == 0)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt_eval(metrics: Mapping[str, float]) -> str:
    if not metrics:
        return "-"
    return f"accuracy {metrics.get('eval/accuracy', math.nan):.3f}, mean reward {metrics.get('eval/reward_mean', math.nan):.3f}"


def _fmt_summary(summary: Mapping[str, Any]) -> str:
    def num(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = [
        f"train reward (mean of first/last 3 steps): {num(summary['reward_first_k_mean'])} -> "
        f"{num(summary['reward_last_k_mean'])}"
    ]
    before = summary["eval_before"].get("eval/accuracy")
    after = summary["eval_after"].get("eval/accuracy")
    if before is not None and after is not None:
        lines.append(f"greedy eval accuracy: {before:.3f} -> {after:.3f} ({after - before:+.3f})")
    lines.append(f"outputs: {summary['output_dir']}")
    return "\n".join(lines)
