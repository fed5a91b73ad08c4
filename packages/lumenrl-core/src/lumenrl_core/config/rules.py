"""Value rules checked at config load: numeric ranges per field and a few cross-field checks.

Ranges come from two places: the table below for the fields of ``schema.py``, and field
metadata for fields added later: ``field(default=1, metadata={"ge": 1})`` (keys ``ge``, ``gt``,
``le``, ``lt``). A range on a ``list[...]`` field applies to every element.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lumenrl_core.config import schema as s
from lumenrl_core.config.errors import ConfigError

__all__ = ["Range", "field_range", "check_range", "cross_check", "join_key"]


@dataclass(frozen=True, slots=True)
class Range:
    """Closed/open numeric bounds; None = unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self, kind: str) -> str:
        """``"int >= 1"``, ``"float in (0, 1]"``, ...; just ``kind`` when unbounded."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            opening, closing = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            return f"{kind} in {opening}{_num(low)}, {_num(high)}{closing}"
        if low is not None:
            return f"{kind} {'>=' if self.ge is not None else '>'} {_num(low)}"
        if high is not None:
            return f"{kind} {'<=' if self.le is not None else '<'} {_num(high)}"
        return kind


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


POSITIVE = Range(ge=1)  # sizes and counts
NON_NEGATIVE = Range(ge=0)
STRICTLY_POSITIVE = Range(gt=0)
UNIT = Range(ge=0, le=1)  # probabilities, fractions
HALF_OPEN_UNIT = Range(gt=0, le=1)

RULES: dict[type, dict[str, Range]] = {
    s.RunConfig: {"seed": NON_NEGATIVE, "num_training_steps": NON_NEGATIVE},
    s.ClusterConfig: {"num_nodes": POSITIVE, "gpus_per_node": NON_NEGATIVE},
    s.OptimConfig: {
        "lr": NON_NEGATIVE,
        "weight_decay": NON_NEGATIVE,
        "betas": Range(ge=0, lt=1),
        "eps": STRICTLY_POSITIVE,
        "warmup_steps": NON_NEGATIVE,
        "min_lr_ratio": UNIT,
    },
    s.PolicyTrainConfig: {
        "ppo_epochs": POSITIVE,
        "mini_batch_size": NON_NEGATIVE,
        "micro_batch_size": POSITIVE,
    },
    s.SamplingConfig: {
        "n": POSITIVE,
        "tensor_parallel_size": POSITIVE,
        "temperature": NON_NEGATIVE,
        "top_p": HALF_OPEN_UNIT,
        "top_k": Range(ge=-1),
        "max_new_tokens": POSITIVE,
        "stop_token_ids": NON_NEGATIVE,
        "max_batch_size": POSITIVE,
        "gpu_memory_utilization": HALF_OPEN_UNIT,
    },
    s.PolicyConfig: {"max_prompt_length": POSITIVE},
    s.LoraConfig: {"rank": NON_NEGATIVE, "alpha": STRICTLY_POSITIVE, "dropout": Range(ge=0, lt=1)},
    s.AlgorithmConfig: {
        "clip_ratio_low": UNIT,
        "clip_ratio_high": NON_NEGATIVE,
        "gamma": UNIT,
        "lam": UNIT,
        "kl_loss_coef": NON_NEGATIVE,
        "kl_reward_coef": NON_NEGATIVE,
        "max_num_gen_batches": POSITIVE,
        "overlong_buffer_len": NON_NEGATIVE,
        "overlong_penalty_factor": NON_NEGATIVE,
    },
    s.DatasetConfig: {"train_batch_size": POSITIVE, "num_examples": POSITIVE, "difficulty": POSITIVE},
    s.RolloutQuantConfig: {"skip_first_n_layers": NON_NEGATIVE, "skip_last_n_layers": NON_NEGATIVE},
    s.RolloutCorrectionConfig: {
        "clip": STRICTLY_POSITIVE,
        "mask_low": NON_NEGATIVE,
        "mask_high": STRICTLY_POSITIVE,
        "extreme_tau": Range(ge=1),
    },
    s.MoEConfig: {"expert_parallel_size": POSITIVE},
    s.ParallelConfig: {"tp": POSITIVE, "cp": POSITIVE, "pp": POSITIVE},
    s.CriticConfig: {"cliprange_value": STRICTLY_POSITIVE, "value_loss_coef": NON_NEGATIVE},
    s.CheckpointingConfig: {"save_every": NON_NEGATIVE, "keep_last": NON_NEGATIVE},
    s.LoggerConfig: {"log_every": POSITIVE},
    s.WeightSyncConfig: {"bucket_size_mb": POSITIVE},
    s.AsyncTrainingConfig: {
        "staleness_threshold": NON_NEGATIVE,
        "trigger_parameter_sync_step": POSITIVE,
        "require_batches": POSITIVE,
        "queue_size": NON_NEGATIVE,
    },
    s.RayConfig: {"num_cpus_per_worker": NON_NEGATIVE},
    s.TrainerConfig: {
        "test_freq": NON_NEGATIVE,
        "total_epochs": NON_NEGATIVE,
        "warm_start_sft_steps": NON_NEGATIVE,
    },
    s.EvalConfig: {"num_examples": NON_NEGATIVE, "temperature": NON_NEGATIVE, "every": NON_NEGATIVE},
}


def field_range(cls: type, name: str, metadata: Mapping[str, Any]) -> Range | None:
    """The range of field ``name`` of dataclass ``cls``: field metadata first, then the table."""
    bounds = {k: metadata[k] for k in ("ge", "gt", "le", "lt") if k in metadata}
    if bounds:
        return Range(**bounds)
    return RULES.get(cls, {}).get(name)


def check_range(rng: Range | None, value: Any, key: str, source: str | None) -> None:
    """Raise ConfigError if a number (or any number in a list) lies outside ``rng``."""
    if rng is None:
        return
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if isinstance(item, (int, float)) and not isinstance(item, bool) and not rng.contains(item):
            where = f"{key}[{i}]" if isinstance(value, list) else key
            kind = "int" if isinstance(item, int) else "float"
            raise ConfigError(where, item, problem="out of range", allowed=rng.describe(kind), source=source)


def join_key(prefix: str, name: str) -> str:
    """``"a.b"`` + ``"c"`` -> ``"a.b.c"``; a top-level name stays as it is."""
    return f"{prefix}.{name}" if prefix else name


def _check_betas(cfg: s.OptimConfig, key: str, source: Callable[[str], str | None]) -> None:
    if len(cfg.betas) != 2:
        k = join_key(key, "betas")
        raise ConfigError(
            k, cfg.betas, problem="needs exactly 2 values", allowed="[beta1, beta2]", source=source(k)
        )


def _check_mask_band(cfg: s.RolloutCorrectionConfig, key: str, source: Callable[[str], str | None]) -> None:
    if cfg.mask_low is not None and cfg.mask_high is not None and cfg.mask_low >= cfg.mask_high:
        k = join_key(key, "mask_high")
        raise ConfigError(
            k,
            cfg.mask_high,
            problem="MIS band is empty",
            allowed=f"a float > mask_low ({cfg.mask_low})",
            source=source(k),
        )


def _check_r3(cfg: s.R3Config, key: str, source: Callable[[str], str | None]) -> None:
    if cfg.enabled and cfg.replay_mode == "distribution" and not cfg.record_router_logits:
        k = join_key(key, "record_router_logits")
        raise ConfigError(k, False, problem="replay_mode 'distribution' replays the recorded router probabilities",
                          allowed="true (or replay_mode: hard_assignment)", source=source(k))


_DISPATCH_MODES = ("dp_compute_proto", "dp_compute", "dp_compute_proto_with_func", "dp_compute_metric",
                   "one_to_all", "all_to_all", "rank_zero")
# the modes a role's batch method (compute_log_prob, compute_ref_log_prob, compute_values, generate) can
# take and still return one batch: training roles run a collective forward on every rank (dp only);
# a rollout group may also let replica 0 alone generate the whole batch
_ROLE_MODES = {"actor": ("dp_compute_proto",), "ref": ("dp_compute_proto",), "critic": ("dp_compute_proto",),
               "rollout": ("dp_compute_proto", "rank_zero")}
_ROLE_KEYS = ("dispatch_mode", "num_workers")


def _check_ray_roles(cfg: s.RayConfig, key: str, source: Callable[[str], str | None]) -> None:
    """``controller.ray.roles.<role>.{dispatch_mode, num_workers}``: known roles/keys, modes normalized
    (``broadcast`` -> ``one_to_all``), ``direct_rollout_method`` refused, worker counts consistent."""
    for role, spec in cfg.roles.items():
        rk = join_key(key, f"roles.{role}")
        if role not in _ROLE_MODES:
            raise ConfigError(rk, spec, problem="unknown role", allowed=", ".join(_ROLE_MODES), source=source(rk))
        if not isinstance(spec, dict) or set(spec) - set(_ROLE_KEYS):
            raise ConfigError(rk, spec, problem="a role takes only these keys", allowed=", ".join(_ROLE_KEYS),
                              source=source(rk))
        if "dispatch_mode" in spec:
            mk, mode = f"{rk}.dispatch_mode", {"broadcast": "one_to_all"}.get(spec["dispatch_mode"], spec["dispatch_mode"])
            if mode == "direct_rollout_method":
                raise ConfigError(mk, mode, problem="refused: it bypasses the controller's dispatch",
                                  allowed=", ".join(_ROLE_MODES[role]), source=source(mk))
            if mode not in _DISPATCH_MODES or mode not in _ROLE_MODES[role]:
                alias = " (broadcast is read as one_to_all)" if spec["dispatch_mode"] == "broadcast" else ""
                raise ConfigError(mk, spec["dispatch_mode"], problem=f"not a dispatch mode the {role} batch method "
                                  f"can take{alias}; it must return one batch",
                                  allowed=", ".join(_ROLE_MODES[role]), source=source(mk))
            spec["dispatch_mode"] = mode
        if "num_workers" in spec:
            nk, n = f"{rk}.num_workers", spec["num_workers"]
            want = cfg.rollout_workers or cfg.num_workers if role == "rollout" else cfg.num_workers
            if not isinstance(n, int) or n != want:
                field_name = "rollout_workers" if role == "rollout" else "num_workers"
                raise ConfigError(nk, n, problem=f"must equal controller.ray.{field_name} (roles share its pool)",
                                  allowed=str(want), source=source(nk))


def _check_exact_logprobs(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    """policy.rollout.exact_logprobs: both sides must run the same full-precision batch-invariant kernels."""
    rollout = cfg.policy.rollout
    if not rollout.exact_logprobs:
        return
    k = join_key(key, "policy.rollout.exact_logprobs")
    quant = cfg.quantization.rollout
    problems = [
        (quant.precision in ("fp8", "mxfp8", "mxfp4"),
         f"quantization.rollout.precision={quant.precision!r}: a low-precision rollout computes other numbers than the trainer"),
        (quant.kv_cache_dtype != "auto", f"quantization.rollout.kv_cache_dtype={quant.kv_cache_dtype!r}: an FP8 KV cache rounds K/V"),
        (cfg.quantization.training.precision in ("fp8", "mxfp8", "mxfp4"),
         f"quantization.training.precision={cfg.quantization.training.precision!r}: low-precision training GEMMs"),
        (rollout.compile != "none", f"policy.rollout.compile={rollout.compile!r}: the batch-invariant kernels run eagerly"),
        (rollout.fused_moe == "on", "policy.rollout.fused_moe='on': the fused experts kernel is not the trainer's"),
        (bool(cfg.policy.train.compile_layers), "policy.train.compile_layers: the batch-invariant kernels run eagerly"),
        (cfg.policy.rollout_engine != "native", f"policy.rollout_engine={cfg.policy.rollout_engine!r}: only 'native' runs the trainer's kernels"),
        ((cfg.policy.dtype, cfg.policy.train.mixed_precision) in (("float16", "auto"), ("float16", "bf16"), ("float16", "fp32"),
                                                                  ("float32", "bf16"), ("bfloat16", "fp32")),
         f"policy.dtype={cfg.policy.dtype!r} and policy.train.mixed_precision={cfg.policy.train.mixed_precision!r}: "
         "the engine would compute in another dtype than the trainer"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(k, True, problem=f"cannot be combined with {why}", allowed="false, or change that key",
                              source=source(k))


def _check_fused_moe(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    """policy.rollout.fused_moe='on' is a native-engine option: another engine would ignore it."""
    if cfg.policy.rollout.fused_moe == "on" and cfg.policy.rollout_engine != "native":
        k = join_key(key, "policy.rollout.fused_moe")
        raise ConfigError(k, "on", problem=f"only the native engine runs fused MoE experts; policy.rollout_engine="
                          f"{cfg.policy.rollout_engine!r} would ignore it", allowed="auto, off", source=source(k))


def _check_native_kernels(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    """policy.rollout.decode_linear / pdl choose native-engine kernels: another engine, or a native engine whose
    projections are not fused (fuse_projections false, exact_logprobs), would ignore a non-default value."""
    rollout = cfg.policy.rollout
    for name, value, default in (("decode_linear", rollout.decode_linear, "auto"), ("pdl", rollout.pdl, True)):
        if value != default and cfg.policy.rollout_engine != "native":
            k = join_key(key, f"policy.rollout.{name}")
            raise ConfigError(k, value, problem=f"only the native engine has these decode kernels; policy.rollout_engine="
                              f"{cfg.policy.rollout_engine!r} would ignore it", allowed=str(default), source=source(k))
    if rollout.decode_linear == "on" and (not rollout.fuse_projections or rollout.exact_logprobs):
        k = join_key(key, "policy.rollout.decode_linear")
        why = "policy.rollout.fuse_projections=false" if not rollout.fuse_projections else "policy.rollout.exact_logprobs"
        raise ConfigError(k, "on", problem=f"the decode kernel runs the fused projections, which {why} turns off",
                          allowed="auto, off", source=source(k))


def _check_old_log_probs(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    """algorithm.old_log_probs='reuse': valid only where the update's forward is the first to need them (the
    async trainer's proximal policy, the policy before its one update, is that forward's too)."""
    if cfg.algorithm.old_log_probs != "reuse":
        return
    k = join_key(key, "algorithm.old_log_probs")
    train, rows = cfg.policy.train, cfg.dataset.train_batch_size * cfg.policy.rollout.n
    problems = [
        (cfg.trainer.name not in ("rl", "async_rl"),
         f"trainer.name={cfg.trainer.name!r}: only the 'rl' and 'async_rl' trainers reuse them"),
        (cfg.trainer.name == "async_rl" and not cfg.async_training.recompute_proximal_log_probs,
         "async_training.recompute_proximal_log_probs=false: the old log-probs are then the rollout's"),
        (cfg.trainer.name == "async_rl" and train.mini_batch_size > 0 and cfg.async_training.require_batches > 1,
         f"async_training.require_batches={cfg.async_training.require_batches} mini-batches of "
         f"policy.train.mini_batch_size={train.mini_batch_size} per step: later mini-batches need the log-probs before "
         "the first update"),
        (train.ppo_epochs != 1, f"policy.train.ppo_epochs={train.ppo_epochs}: later epochs need the log-probs "
                                "before the first update"),
        (0 < train.mini_batch_size < rows, f"policy.train.mini_batch_size={train.mini_batch_size} < {rows} rows per "
                                           "step: later mini-batches need the log-probs before the first update"),
        (cfg.algorithm.use_kl_in_reward, "algorithm.use_kl_in_reward: the reward's KL reads them before the update"),
        (cfg.quantization.rollout_correction.enabled,
         "quantization.rollout_correction.enabled: the correction weights read them before the update"),
        (cfg.moe.r3.enabled, "moe.r3.enabled: the routing step metrics read them"),
        (cfg.policy.rollout.exact_logprobs, "policy.rollout.exact_logprobs: its check reads them"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(k, "reuse", problem=f"cannot be combined with {why}", allowed="recompute, or change that key",
                              source=source(k))


def _check_group_projections(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    """policy.train.group_projections='on' runs on the one-rank path without exact log-probs; what the config
    already rules out is refused here (the rank count is the backend's to check)."""
    if cfg.policy.train.group_projections != "on":
        return
    k = join_key(key, "policy.train.group_projections")
    problems = [
        (cfg.policy.train.single_device == "off", "policy.train.single_device='off': the groups need the one-rank path"),
        (cfg.quantization.training.precision in ("fp8", "mxfp8", "mxfp4"),
         f"quantization.training.precision={cfg.quantization.training.precision!r}: FP8 training runs through fully_shard"),
        (cfg.policy.rollout.exact_logprobs, "policy.rollout.exact_logprobs: its batch-invariant GEMMs run per module"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(k, "on", problem=f"cannot be combined with {why}", allowed="auto, off, or change that key",
                              source=source(k))


def _check_run(cfg: s.RunConfig, key: str, source: Callable[[str], str | None]) -> None:
    _check_exact_logprobs(cfg, key, source)
    _check_fused_moe(cfg, key, source)
    _check_native_kernels(cfg, key, source)
    _check_old_log_probs(cfg, key, source)
    _check_group_projections(cfg, key, source)


CROSS_CHECKS: dict[type, Callable[[Any, str, Callable[[str], str | None]], None]] = {
    s.OptimConfig: _check_betas,
    s.RolloutCorrectionConfig: _check_mask_band,
    s.R3Config: _check_r3,
    s.RayConfig: _check_ray_roles,
    s.RunConfig: _check_run,
}


def cross_check(obj: Any, key: str, source: Callable[[str], str | None]) -> None:
    """Run the cross-field check registered for ``type(obj)``, if any (``key``: the section's dotted key)."""
    check = CROSS_CHECKS.get(type(obj))
    if check is not None:
        check(obj, key, source)
