"""What a run config demands of its plugins: capabilities per role and config-level rules.

Pure functions of the config (no registry, no imports of plugin code), so each rule is easy to
test and to read. :mod:`lumenrl_core.assembly.planner` applies them to the resolved plugins.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

from lumenrl_core.config.schema import RunConfig

__all__ = [
    "Violation",
    "Need",
    "ROLLOUT_SCHEME_BY_PRECISION",
    "rollout_scheme_name",
    "required_capabilities",
    "config_violations",
    "moe_layout_supported",
    "check_reward_function",
    "RUN_FEATURES",
    "run_features",
    "unmet_requirements",
    "config_value",
]

ROLLOUT_SCHEME_BY_PRECISION = {"fp8": "fp8_block", "mxfp8": "mxfp8", "mxfp4": "mxfp4"}
_ENGINE_CAP_BY_PRECISION = {"fp8": "fp8_weights", "mxfp8": "mx_weights", "mxfp4": "mx_weights"}
_TRAINING_PRECISIONS = ("bf16", "fp32", "fp8")
_REWARD_FN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: the config key, its value, and what is wrong / allowed.

    ``fatal`` violations (a plugin that cannot be resolved at all) fail assembly even when
    ``assembly.strict_policy`` is false: there is nothing to build.
    """

    key: str
    value: Any
    problem: str
    fatal: bool = False

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.problem}"


@dataclass(frozen=True, slots=True)
class Need:
    """Role ``role`` must declare capability ``capability`` because ``because_key=because_value``."""

    role: str
    capability: str
    because_key: str
    because_value: Any


# What a plugin may name in its spec's ``requires``: feature -> (the config key that provides it, how to).
# ``task:<name>`` is provided by ``dataset.name=<name>`` (the rows' task: prompts, answer format, fields).
RUN_FEATURES: dict[str, tuple[str, str]] = {
    "critic": ("critic.enabled", "set critic.enabled=true (the batch then carries the critic's 'values')"),
}
_TASK_PREFIX = "task:"


def run_features(cfg: RunConfig) -> frozenset[str]:
    """The run features ``cfg`` provides to its plugins: ``critic`` when ``critic.enabled`` (value
    estimates in every batch), ``task:<dataset.name>`` always (the task the rows come from)."""
    features = {f"{_TASK_PREFIX}{cfg.dataset.name}"}
    if cfg.critic.enabled:
        features.add("critic")
    return frozenset(features)


def _unmet(feature: str, cfg: RunConfig) -> str:
    """Why ``cfg`` does not provide ``feature`` and what would."""
    if feature.startswith(_TASK_PREFIX):
        task = feature.removeprefix(_TASK_PREFIX)
        return f"dataset.name={cfg.dataset.name!r}; it scores rows of task {task!r} (dataset.name={task!r})"
    if feature in RUN_FEATURES:
        key, how = RUN_FEATURES[feature]
        return f"{key}={config_value(cfg, key)!r}; {how}"
    known = ", ".join([*RUN_FEATURES, f"{_TASK_PREFIX}<dataset.name>"])
    return f"no config provides it (unknown run feature; known: {known})"


def config_value(cfg: RunConfig, key: str) -> Any:
    """The value at dotted ``key`` of ``cfg`` (``"critic.enabled"``)."""
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def unmet_requirements(
    cfg: RunConfig, *, kind: str, name: str, key: str, requires: frozenset[str], package: str
) -> list[Violation]:
    """One violation per feature in a plugin's ``requires`` that ``cfg`` does not provide (see
    :func:`run_features`), naming the plugin, its package and the config key that would provide it."""
    provided = run_features(cfg)
    return [
        Violation(key, name, f"{kind} plugin {name!r} ({package}) requires run feature {feature!r}, "
                             f"which this config does not provide: {_unmet(feature, cfg)}")
        for feature in sorted(requires - provided)
    ]


def rollout_scheme_name(cfg: RunConfig) -> str | None:
    """The ``lumenrl.quant_schemes`` name the rollout uses: the explicit scheme, else derived."""
    rollout = cfg.quantization.rollout
    return rollout.scheme or ROLLOUT_SCHEME_BY_PRECISION.get(rollout.precision)


def required_capabilities(cfg: RunConfig) -> list[Need]:
    """Capabilities the config requires of the rollout engine and the training backend."""
    q = cfg.quantization
    needs: list[Need] = []
    if q.rollout.precision in _ENGINE_CAP_BY_PRECISION:
        cap = _ENGINE_CAP_BY_PRECISION[q.rollout.precision]
        needs.append(Need("rollout_engine", cap, "quantization.rollout.precision", q.rollout.precision))
    if q.rollout.kv_cache_dtype == "fp8":
        needs.append(Need("rollout_engine", "fp8_kv_cache", "quantization.rollout.kv_cache_dtype", "fp8"))
    if cfg.moe.r3.enabled:
        needs.append(Need("rollout_engine", "route_recording", "moe.r3.enabled", True))
        needs.append(Need("training_backend", "route_replay", "moe.r3.enabled", True))
        if cfg.moe.r3.record_router_logits:
            needs.append(Need("rollout_engine", "router_probs", "moe.r3.record_router_logits", True))
    if (cfg.algorithm.name == "sddd") == (cfg.trainer.name == "sddd"):  # else _algorithm_violations says so
        needs.append(Need("trainer", cfg.algorithm.name, "algorithm.name", cfg.algorithm.name))  # the trainer runs it
    if cfg.async_training.enabled:
        needs.append(Need("trainer", "async", "async_training.enabled", True))
    if cfg.async_training.partial_rollout:
        needs.append(Need("rollout_engine", "interrupt_resume", "async_training.partial_rollout", True))
        if cfg.async_training.resume_kv == "keep":
            needs.append(Need("rollout_engine", "kept_kv_across_updates", "async_training.resume_kv", "keep"))
    if cfg.trainer.name == "async_rl" and cfg.controller.name == "ray":  # the rollouter is an actor, maybe elsewhere
        needs.append(Need("weight_sync", "cross_node", "controller.name", "ray"))
    if cfg.trainer.name == "sddd":
        needs.append(Need("rollout_engine", "hidden_state_capture", "trainer.name", "sddd"))
    if cfg.policy.rollout.speculative.draft_path:
        needs.append(Need("rollout_engine", "speculative_decoding", "policy.rollout.speculative.draft_path",
                          cfg.policy.rollout.speculative.draft_path))
    if q.training.precision == "fp8":
        needs.append(Need("training_backend", "fp8_training", "quantization.training.precision", "fp8"))
    # training keys a backend must read, not skip: value estimates, layer recompute and compile, the one-rank
    # path (a backend without one honours single_device=off anyway), trimmed packing, and the batch-invariant
    # trainer side of exact log-probs (the engine side: _check_exact_logprobs)
    train, rollout = cfg.policy.train, cfg.policy.rollout
    for capability, key, value, needed in (
        ("values", "critic.enabled", cfg.critic.enabled, cfg.critic.enabled),
        ("gradient_checkpointing", "policy.train.gradient_checkpointing", train.gradient_checkpointing,
         train.gradient_checkpointing),
        ("compile_layers", "policy.train.compile_layers", train.compile_layers, train.compile_layers),
        ("single_device", "policy.train.single_device", train.single_device, train.single_device == "on"),
        ("group_projections", "policy.train.group_projections", train.group_projections,
         train.group_projections == "on"),
        ("packing", "policy.train.packing", train.packing, train.packing == "trim"),
        ("exact_logprobs", "policy.rollout.exact_logprobs", rollout.exact_logprobs, rollout.exact_logprobs),
    ):
        if needed:
            needs.append(Need("training_backend", capability, key, value))
    # the trainer runs the exact-log-probs check (policy.rollout.exact_logprobs_check) and online draft steps
    if rollout.exact_logprobs:
        needs.append(Need("trainer", "exact_logprobs", "policy.rollout.exact_logprobs", True))
    if rollout.speculative.draft_path and rollout.speculative.online_sddd_steps:
        needs.append(Need("trainer", "online_sddd", "policy.rollout.speculative.online_sddd_steps",
                          rollout.speculative.online_sddd_steps))
    # engine keys away from their defaults: the engine must read them (the native engine's own knobs; the KV
    # memory share, which vLLM and SGLang take too)
    defaults = type(rollout)()
    for capability, key in (("cuda_graphs", "cuda_graphs"), ("compile", "compile"),
                            ("fuse_projections", "fuse_projections"), ("overlap_sync", "overlap_sync"),
                            ("share_prefill", "share_prefill"), ("pack_prefill", "pack_prefill"),
                            ("kv_block", "kv_block"),
                            ("gpu_memory_utilization", "gpu_memory_utilization")):
        if getattr(rollout, key) != getattr(defaults, key):
            needs.append(Need("rollout_engine", capability, f"policy.rollout.{key}", getattr(rollout, key)))
    if cfg.policy.lora.rank > 0:
        needs.append(Need("training_backend", "lora", "policy.lora.rank", cfg.policy.lora.rank))
    if cfg.moe.expert_parallel_size > 1:
        ep = cfg.moe.expert_parallel_size
        needs.append(Need("training_backend", "expert_parallel", "moe.expert_parallel_size", ep))
    par = cfg.policy.parallel
    for key, degree, capability in (("tp", par.tp, "tensor_parallel"), ("cp", par.cp, "context_parallel"),
                                    ("pp", par.pp, "pipeline_parallel")):
        if degree > 1:
            needs.append(Need("training_backend", capability, f"policy.parallel.{key}", degree))
            # the ranks of a TP/CP/PP group need the same rows: torchrun ranks each holding the batch
            # (an in-process controller), not a controller that splits the rows over every worker
            needs.append(Need("controller", "in_process", f"policy.parallel.{key}", degree))
    return needs


_TP_ROLLOUT_ENGINES = ("vllm", "sglang")  # engines that shard a model for decode (decision 0016)


def _local_model_config(name: str) -> dict[str, Any] | None:
    """The model's config.json when ``name`` is a local directory (no torch), else ``None``."""
    path = Path(name) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _parallel_violations(cfg: RunConfig) -> list[Violation]:
    """Mesh sizes the world or the model cannot meet, with the numbers (model sizes from a local config.json)."""
    par, out = cfg.policy.parallel, []
    tps = cfg.policy.rollout.tensor_parallel_size
    if tps > 1 and cfg.policy.rollout_engine not in _TP_ROLLOUT_ENGINES:
        out.append(Violation("policy.rollout.tensor_parallel_size", tps,
                             f"rollout engine {cfg.policy.rollout_engine!r} decodes on one device; "
                             f"use policy.rollout_engine={' or '.join(map(repr, _TP_ROLLOUT_ENGINES))} for tensor parallel decode"))
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    model_parallel = par.tp * par.cp * par.pp
    if world and world % model_parallel:
        out.append(Violation("policy.parallel", f"tp={par.tp} cp={par.cp} pp={par.pp}",
                             f"tp*cp*pp={model_parallel} must divide the world size {world} (cluster.num_nodes*gpus_per_node)"))
    model = _local_model_config(cfg.policy.model_name)
    if model is None:
        return out  # hub id or built-in: the backend checks at build
    sizes = {"num_attention_heads": model.get("num_attention_heads"),
             "num_key_value_heads": model.get("num_key_value_heads") or model.get("num_attention_heads")}
    for key, degree in (("policy.parallel.tp", par.tp), ("policy.parallel.cp", par.cp)):
        if key.endswith("tp"):  # TP also splits the experts' intermediate dim (MoE families)
            sizes = {**sizes, "moe_intermediate_size": model.get("moe_intermediate_size")}
        bad = [f"{k}={v}" for k, v in sizes.items() if degree > 1 and isinstance(v, int) and v % degree]
        if bad:
            out.append(Violation(key, degree, f"does not divide {', '.join(bad)} of {cfg.policy.model_name}"))
    ep = cfg.moe.expert_parallel_size
    experts = next((model[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in model), None)
    if ep > 1 and isinstance(experts, int) and experts % ep:
        out.append(Violation("moe.expert_parallel_size", ep, f"does not divide the {experts} experts of {cfg.policy.model_name}"))
    return out


def _precision_violations(cfg: RunConfig) -> list[Violation]:
    q = cfg.quantization
    out = []
    if q.training.precision not in _TRAINING_PRECISIONS:
        out.append(Violation("quantization.training.precision", q.training.precision,
                             f"not supported for training (rollout only); allowed: {', '.join(_TRAINING_PRECISIONS)}"))
    if q.rollout.scheme and q.rollout.precision not in ROLLOUT_SCHEME_BY_PRECISION:
        out.append(Violation("quantization.rollout.scheme", q.rollout.scheme,
                             f"has no effect with quantization.rollout.precision={q.rollout.precision!r}; "
                             f"set precision to one of {', '.join(ROLLOUT_SCHEME_BY_PRECISION)} or clear the scheme"))
    return out


def _algorithm_violations(cfg: RunConfig) -> list[Violation]:
    algo, critic = cfg.algorithm, cfg.critic.enabled
    out = []
    if algo.name == "ppo":
        if not critic:
            out.append(Violation("critic.enabled", False, "algorithm.name='ppo' needs a critic; set critic.enabled=true"))
        if algo.adv_estimator != "gae":
            out.append(Violation("algorithm.adv_estimator", algo.adv_estimator,
                                 "algorithm.name='ppo' uses value-based advantages; allowed: 'gae'"))
    # an estimator that needs the critic's values (gae) says so in its spec: requires={"critic"}
    if algo.name == "dapo":  # DAPO is GRPO with decoupled clipping and dynamic sampling: the name alone is not it
        if not algo.dynamic_sampling:
            out.append(Violation("algorithm.dynamic_sampling", False, "algorithm.name='dapo' samples dynamically "
                                 "(groups with equal rewards dropped and refilled); set it true, or algorithm.name=grpo"))
        if not algo.clip_ratio_high > algo.clip_ratio_low:
            out.append(Violation("algorithm.clip_ratio_high", algo.clip_ratio_high, "algorithm.name='dapo' clips "
                                 f"higher than low (clip_ratio_low={algo.clip_ratio_low}); allowed: a float > "
                                 f"{algo.clip_ratio_low} (the paper: 0.28), or algorithm.name=grpo"))
    if (algo.name == "sddd") != (cfg.trainer.name == "sddd"):
        key, value = ("trainer.name", cfg.trainer.name) if algo.name == "sddd" else ("algorithm.name", algo.name)
        out.append(Violation(key, value, "algorithm.name='sddd' and trainer.name='sddd' go together (draft "
                             "distillation has its own trainer); allowed: both 'sddd' or neither"))
    return out


def _lora_violations(cfg: RunConfig) -> list[Violation]:
    rank = cfg.policy.lora.rank
    if rank <= 0:
        return []
    out = []
    if cfg.quantization.training.precision == "fp8":
        out.append(Violation("policy.lora.rank", rank,
                             "LoRA adapters on FP8 training linears are not supported; use "
                             "quantization.training.precision=bf16 with LoRA, or policy.lora.rank=0"))
    if cfg.policy.parallel.tp > 1 and cfg.policy.lora.dropout > 0:
        out.append(Violation("policy.lora.dropout", cfg.policy.lora.dropout,
                             f"draws a different mask on each rank of a tensor-parallel group (policy.parallel.tp="
                             f"{cfg.policy.parallel.tp}) for a replicated adapter input; use 0.0 with tp > 1"))
    if importlib.util.find_spec("peft") is None:
        out.append(Violation("policy.lora.rank", rank,
                             "LoRA needs peft, which is not installed (pip install 'lumenrl-backends[lora]')"))
    return out


def check_reward_function(spec: str) -> str | None:
    """``None`` if ``spec`` is ``"module:function"`` naming an importable module, or
    ``"path/to/file.py:function"`` naming an existing file; else the problem."""
    path, sep, attr = spec.rpartition(":")
    if path.endswith(".py") and sep and re.fullmatch(r"[A-Za-z_]\w*", attr):
        return None if Path(path).expanduser().is_file() else f"file {path!r} does not exist"
    if not _REWARD_FN.match(spec):
        return ("expected 'package.module:function' (dotted module path, a colon, a function name) "
                "or 'path/to/file.py:function'")
    module = spec.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"module {module!r} cannot be found: {exc}"
    return None if found is not None else f"module {module!r} cannot be found on sys.path"


MOE_LAYOUT_TRANSFORMERS = "5.13"  # first transformers whose MoE routers (DeepSeek-V3 and GLM-4-MoE too) return
# (logits, weights, indices) with one fused experts module (5.0-5.12: those two route in the block)


def _installed_transformers() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def moe_layout_supported(installed: str | None = None) -> bool:
    """The installed transformers has the MoE layout R3, expert parallelism and fused experts need."""
    installed = installed or _installed_transformers()
    return installed is None or Version(installed) >= Version(MOE_LAYOUT_TRANSFORMERS)


def _moe_layout_violations(cfg: RunConfig, installed: str | None = None) -> list[Violation]:
    """R3, expert parallelism and the fused experts work on transformers >= 5's MoE layout (a router
    module returning (logits, weights, indices) and one fused experts module); older layouts are refused."""
    installed = installed or _installed_transformers()
    if moe_layout_supported(installed):
        return []
    why = (f"needs transformers>={MOE_LAYOUT_TRANSFORMERS} (its MoE layout: router module + fused experts); "
           f"installed {installed}")
    out = []
    if cfg.moe.r3.enabled:
        out.append(Violation("moe.r3.enabled", True, why))
    if cfg.moe.expert_parallel_size > 1:
        out.append(Violation("moe.expert_parallel_size", cfg.moe.expert_parallel_size, why))
    if cfg.policy.rollout.fused_moe == "on":
        out.append(Violation("policy.rollout.fused_moe", "on", why))
    return out


def config_violations(cfg: RunConfig) -> list[Violation]:
    """Config-level rules that need no plugin: precisions, algorithm/critic, async, reward function."""
    out = (_precision_violations(cfg) + _algorithm_violations(cfg) + _parallel_violations(cfg)
           + _lora_violations(cfg) + _moe_layout_violations(cfg))
    a = cfg.async_training
    if a.partial_rollout and not a.enabled:
        out.append(Violation("async_training.partial_rollout", True,
                             "partial rollout only exists in async training; set async_training.enabled=true"))
    if cfg.moe.r3.enabled and cfg.policy.rollout.speculative.draft_path:
        out.append(Violation("moe.r3.enabled", True, "speculative decoding (policy.rollout.speculative.draft_path) "
                             "does not record routes; allowed: false, or no draft_path"))
    if cfg.reward.function:
        problem = check_reward_function(cfg.reward.function)
        if problem:
            out.append(Violation("reward.function", cfg.reward.function, problem))
    return out
