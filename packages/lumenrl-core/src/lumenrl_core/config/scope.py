"""Keys that count only while another key switches their reader on: set otherwise, they are refused at load.

A run reads many keys only under some other key's value: ``critic.*`` only with a critic, ``sddd.*`` only
in the draft-distillation trainer, ``controller.ray.*`` only with the Ray controller, a generated task's
``dataset.difficulty`` only when no file is read. Each :class:`Scope` names such keys (a section name covers
every key under it) and the condition under which they are read. A key set to anything but its schema
default while its scope's condition is false fails at load with one line: the key, its value, who reads
it, and what would make it count (its default, or the switch), unless a later config layer than the one that
set it switched its reader off (then it is reset to its default and logged: see :func:`scope_errors`). ``async_training.*`` has its own check
(:mod:`.semantic`), as do plugin-specific keywords (assembly, :mod:`lumenrl_core.assembly.plan`) and the
engine/backend keys a plugin must declare a capability for (:mod:`lumenrl_core.assembly.requirements`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lumenrl_core.builtins import is_builtin_name
from lumenrl_core.config.errors import ConfigError
from lumenrl_core.config.schema import RunConfig

__all__ = ["Scope", "SCOPES", "scope_errors"]

_FILE_DATASETS = ("jsonl", "parquet")
_log = logging.getLogger("lumenrl.config")


@dataclass(frozen=True, slots=True)
class Scope:
    """``keys`` (dotted; a section covers its keys, minus ``skip``) are read only when ``read(cfg)``, a function
    of the keys ``on``; ``why(cfg)`` says who reads them and what the config has instead; ``switch`` what would
    make them count."""

    keys: tuple[str, ...]
    read: Callable[[RunConfig], bool]
    why: Callable[[RunConfig], str]
    switch: str
    on: tuple[str, ...]  # the keys ``read`` looks at
    skip: tuple[str, ...] = ()


def _sddd(cfg: RunConfig) -> bool:
    return cfg.trainer.name == "sddd"


# keys of the RL trainers that the draft-distillation trainer never reads (it reads the teacher model keys,
# the engine's sizes and kernels, the run's outputs, checkpoints, loggers, eval.every and sddd.*)
_RL_ONLY = (
    "algorithm", "reward", "dataset", "critic", "moe", "controller", "weight_sync",
    "policy.optim", "policy.train", "policy.lora", "policy.parallel", "policy.training_backend",
    "quantization.training", "quantization.rollout_correction",
    "policy.rollout.n", "policy.rollout.temperature", "policy.rollout.top_p", "policy.rollout.top_k",
    "policy.rollout.stop_token_ids", "policy.rollout.ignore_eos",
    "trainer.warm_start_sft_steps", "trainer.warm_start_sft_lr", "trainer.warm_start_sft_batch_size",
    "trainer.test_freq", "trainer.total_epochs", "eval.enabled", "eval.num_examples", "eval.temperature",
    "checkpointing.export_hf",
)

SCOPES: tuple[Scope, ...] = (
    # --- the draft-distillation trainer and its draft kinds
    Scope(("sddd",), _sddd, lambda c: f"only trainer.name=sddd reads sddd.* (trainer.name={c.trainer.name!r})",
          "trainer.name=sddd with algorithm.name=sddd", ("trainer.name",)),
    Scope(_RL_ONLY, lambda c: not _sddd(c), lambda c: "trainer.name='sddd' distils a draft from the teacher and "
          "reads no RL training, data, reward or evaluation key", "an RL trainer (trainer.name=rl or async_rl)", ("trainer.name",),
          skip=("algorithm.name",)),
    Scope(("sddd.ttt_steps", "sddd.draft_vocab_size"), lambda c: c.sddd.draft == "eagle3",
          lambda c: f"read by the eagle3 draft only (sddd.draft={c.sddd.draft!r})", "sddd.draft=eagle3", ("sddd.draft",)),
    Scope(("sddd.num_draft_tokens",), lambda c: c.sddd.draft != "dflash",
          lambda c: "a dflash draft proposes sddd.block_size - 1 tokens per verify step", "sddd.draft=eagle3", ("sddd.draft",)),
    Scope(("sddd.num_aux_layers",), lambda c: c.sddd.draft == "dflash",
          lambda c: f"read by the dflash draft only (sddd.draft={c.sddd.draft!r})", "sddd.draft=dflash", ("sddd.draft",)),
    Scope(("sddd.dflash_layers", "sddd.block_size", "sddd.gamma"), lambda c: c.sddd.draft != "eagle3",
          lambda c: "read by block drafts (dflash), not by the eagle3 draft", "sddd.draft=dflash", ("sddd.draft",)),
    Scope(("sddd.tcp_host", "sddd.tcp_port"), lambda c: c.sddd.transfer_engine == "tcp",
          lambda c: f"read by the tcp transfer engine only (sddd.transfer_engine={c.sddd.transfer_engine!r})",
          "sddd.transfer_engine=tcp", ("sddd.transfer_engine",)),
    # --- features switched off
    Scope(("critic",), lambda c: c.critic.enabled, lambda c: "no critic is built (critic.enabled=false)",
          "critic.enabled=true", ("critic.enabled",), skip=("critic.enabled",)),
    Scope(("policy.lora",), lambda c: c.policy.lora.rank > 0, lambda c: "no adapters (policy.lora.rank=0)",
          "policy.lora.rank > 0", ("policy.lora.rank",), skip=("policy.lora.rank",)),
    Scope(("moe.r3",), lambda c: c.moe.r3.enabled, lambda c: "R3 is off (moe.r3.enabled=false)", "moe.r3.enabled=true", ("moe.r3.enabled",),
          skip=("moe.r3.enabled",)),
    Scope(("quantization.training.recipe", "quantization.training.fp8_format", "quantization.training.weight_cache"),
          lambda c: c.quantization.training.precision == "fp8",
          lambda c: f"FP8 training is off (quantization.training.precision={c.quantization.training.precision!r})",
          "quantization.training.precision=fp8", ("quantization.training.precision",)),
    Scope(("quantization.rollout.skip_first_n_layers", "quantization.rollout.skip_last_n_layers",
           "quantization.rollout.quantize_lm_head", "quantization.rollout.fuse_mlp"),
          lambda c: c.quantization.rollout.precision in ("fp8", "mxfp8", "mxfp4"),
          lambda c: f"the rollout weights are not quantized (quantization.rollout.precision="
                    f"{c.quantization.rollout.precision!r})", "quantization.rollout.precision fp8, mxfp8 or mxfp4", ("quantization.rollout.precision",)),
    Scope(("quantization.rollout.kv_scale_recalibration",), lambda c: c.quantization.rollout.kv_cache_dtype == "fp8",
          lambda c: "the KV cache has no scales (quantization.rollout.kv_cache_dtype='auto')",
          "quantization.rollout.kv_cache_dtype=fp8", ("quantization.rollout.kv_cache_dtype",)),
    Scope(("quantization.rollout_correction",), lambda c: c.quantization.rollout_correction.enabled,
          lambda c: "the rollout correction is off (quantization.rollout_correction.enabled=false)",
          "quantization.rollout_correction.enabled=true", ("quantization.rollout_correction.enabled",), skip=("quantization.rollout_correction.enabled",)),
    Scope(("policy.rollout.speculative",), lambda c: bool(c.policy.rollout.speculative.draft_path),
          lambda c: "speculative decoding is off (policy.rollout.speculative.draft_path is empty)",
          "policy.rollout.speculative.draft_path=<a draft>", ("policy.rollout.speculative.draft_path",), skip=("policy.rollout.speculative.draft_path",)),
    Scope(("algorithm.kl_loss_coef",), lambda c: c.algorithm.use_kl_loss,
          lambda c: "no KL loss term (algorithm.use_kl_loss=false)", "algorithm.use_kl_loss=true", ("algorithm.use_kl_loss",)),
    Scope(("algorithm.kl_loss_type",), lambda c: c.algorithm.use_kl_loss or c.algorithm.use_kl_in_reward,
          lambda c: "no KL is computed (algorithm.use_kl_loss and use_kl_in_reward are false)",
          "algorithm.use_kl_loss=true or algorithm.use_kl_in_reward=true", ("algorithm.use_kl_loss", "algorithm.use_kl_in_reward")),
    Scope(("algorithm.kl_reward_coef",), lambda c: c.algorithm.use_kl_in_reward,
          lambda c: "no KL penalty in the reward (algorithm.use_kl_in_reward=false)", "algorithm.use_kl_in_reward=true", ("algorithm.use_kl_in_reward",)),
    Scope(("algorithm.max_num_gen_batches",), lambda c: c.algorithm.dynamic_sampling,
          lambda c: "no refill rounds without algorithm.dynamic_sampling", "algorithm.dynamic_sampling=true", ("algorithm.dynamic_sampling",)),
    Scope(("algorithm.overlong_penalty_factor",), lambda c: c.algorithm.overlong_buffer_len > 0,
          lambda c: "overlong shaping is off (algorithm.overlong_buffer_len=0)", "algorithm.overlong_buffer_len > 0", ("algorithm.overlong_buffer_len",)),
    Scope(("reward.name", "reward.format_score"), lambda c: not c.reward.function,
          lambda c: f"reward.function={c.reward.function!r} scores the rows instead", "reward.function=''", ("reward.function",)),
    Scope(("trainer.test_freq",), lambda c: not c.eval.every,
          lambda c: f"eval.every={c.eval.every} sets the evaluation period (it takes precedence)", "eval.every=0", ("eval.every",)),
    Scope(("eval.every", "eval.num_examples", "eval.temperature", "trainer.test_freq"),
          lambda c: c.eval.enabled or _sddd(c), lambda c: "evaluation is off (eval.enabled=false)",
          "eval.enabled=true", ("eval.enabled", "trainer.name")),
    Scope(("trainer.warm_start_sft_steps", "trainer.warm_start_sft_lr", "trainer.warm_start_sft_batch_size"),
          lambda c: is_builtin_name(c.policy.model_name),
          lambda c: f"the warm-start SFT teaches a built-in lumenrl: demo model its task; policy.model_name="
                    f"{c.policy.model_name!r} is a real checkpoint, which RL starts from as it is",
          "a built-in policy.model_name (lumenrl:...)", ("policy.model_name",)),
    # --- which reader is chosen
    Scope(("dataset.path", "dataset.prompt_key", "dataset.answer_key"),
          lambda c: c.dataset.name in _FILE_DATASETS,
          lambda c: f"dataset.name={c.dataset.name!r} is a generated task; only jsonl/parquet read a file",
          "dataset.name jsonl or parquet", ("dataset.name",)),
    Scope(("dataset.num_examples", "dataset.difficulty"), lambda c: c.dataset.name not in _FILE_DATASETS,
          lambda c: f"dataset.name={c.dataset.name!r} reads its rows from dataset.path", "a generated task", ("dataset.name",)),
    Scope(("controller.ray",), lambda c: c.controller.name == "ray",
          lambda c: f"only controller.name=ray reads controller.ray.* (controller.name={c.controller.name!r})",
          "controller.name=ray", ("controller.name",)),
    Scope(("controller.ray.rollout_workers",), lambda c: not c.controller.ray.colocate,
          lambda c: "colocated roles share the training actors (controller.ray.colocate=true)",
          "controller.ray.colocate=false", ("controller.ray.colocate",)),
    Scope(("controller.ray.release_rollout_memory",),
          lambda c: c.controller.ray.colocate and c.trainer.name == "rl",
          lambda c: "only the synchronous trainer's colocated engines free their KV cache for training "
                    f"(colocate={c.controller.ray.colocate}, trainer.name={c.trainer.name!r})",
          "controller.ray.colocate=true with trainer.name=rl", ("controller.ray.colocate", "trainer.name")),
    Scope(("logger.log_every",), lambda c: "console" in c.logger.backends,
          lambda c: f"only the console logger thins its lines (logger.backends={c.logger.backends})",
          "'console' in logger.backends", ("logger.backends",)),
    Scope(("logger.wandb_project",), lambda c: "wandb" in c.logger.backends,
          lambda c: f"no wandb logger (logger.backends={c.logger.backends})", "'wandb' in logger.backends", ("logger.backends",)),
)


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _leaves(obj: Any, key: str) -> Iterator[str]:
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{key}.{f.name}")
    else:
        yield key


def _set(obj: Any, key: str, value: Any) -> None:
    *parents, name = key.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def _pass(cfg: RunConfig, default: RunConfig, source: Callable[[str], str | None],
          rank: Callable[[str], int] | None) -> tuple[list[ConfigError], list[str]]:
    """One pass over :data:`SCOPES`: the errors, and the keys reset to their defaults (messages)."""
    out, reset, seen = [], [], set()
    for scope in SCOPES:
        if scope.read(cfg):
            continue
        switched = max((rank(k) for k in scope.on), default=-1) if rank is not None else -1
        for key in (leaf for k in scope.keys for leaf in _leaves(_get(cfg, k), k)):
            if key in seen or any(key == s or key.startswith(s + ".") for s in scope.skip):
                continue
            value, base = _get(cfg, key), _get(default, key)
            if value == base:
                continue
            seen.add(key)
            problem = f"has no effect: {scope.why(cfg)}"
            if rank is not None and rank(key) < switched:
                _set(cfg, key, base)
                reset.append(f"config key {key!r} = {value!r} ({source(key)}) {problem}; a later layer switched its "
                             f"reader off, so it is reset to its default {base!r}")
                continue
            out.append(ConfigError(key, value, problem=problem, allowed=f"{base!r} (the default), or {scope.switch}",
                                   source=source(key)))
    return out, reset


def scope_errors(cfg: RunConfig, source: Callable[[str], str | None],
                 rank: Callable[[str], int] | None = None) -> list[ConfigError]:
    """One ConfigError per key set away from its default while no reader of it is switched on.

    ``rank(key)``: the config layer that set ``key`` (later layers higher, -1 unset; None: every key counts as
    set last). A key set in an earlier layer than the switch that turned its reader off (a base file's
    ``critic.*`` under an override ``critic.enabled=false``) is not refused: switching a feature off is what
    that later layer asked for. Its value is reset to the default in ``cfg`` (logged), so the resolved config
    holds no dead setting: its dump (``output_dir/config.yaml``) loads again as one layer, and a process that
    rebuilds it from a dict gets the same config. A reset may turn off another scope's reader, hence passes
    until nothing changes."""
    default = RunConfig()
    while True:
        errors, reset = _pass(cfg, default, source, rank)
        for message in reset:
            _log.warning(message)
        if not reset:
            return errors
