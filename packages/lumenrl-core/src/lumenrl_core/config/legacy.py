"""Keys of the original LumenRL configs, read with their meaning: each maps onto current keys.

:data:`LEGACY` maps an original dotted key to a handler ``(value, get) -> {new_key: new_value}``
(``get(key)`` reads a current key as set so far: this layer first, then earlier layers and the
defaults). :func:`translate` applies it to one config layer (a YAML file or an override) before
the layers merge, so precedence is unchanged: a later layer's current key still wins. Each use
logs one note (once per key and process) naming the current key(s), e.g.::

    note: 'policy.generation_backend' (original LumenRL key) read as policy.rollout_engine='native'

Per-role Ray groups (``controller.ray.<role>.{dispatch_mode, num_workers, ...}``) move under
``controller.ray.roles.<role>`` (checked at load: config/rules.py ``_check_ray_roles``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from lumenrl_core.config.errors import ConfigError

__all__ = ["LEGACY", "translate", "is_legacy_key"]

log = logging.getLogger("lumenrl.config")
Getter = Callable[[str], Any]
Handler = Callable[[Any, Getter], dict[str, Any]]
_NOTED: set[str] = set()
_RAY_FIELDS = ("address", "colocate", "num_cpus_per_worker", "roles", "enabled", "num_workers", "rollout_workers",
               "num_gpus_per_worker", "placement_strategy", "release_rollout_memory")


class _Bad(Exception):
    """A legacy value that has no meaning here: (problem, allowed)."""


def _rename(new: str, values: Mapping[Any, Any] | None = None) -> Handler:
    def handler(value: Any, get: Getter) -> dict[str, Any]:
        if values is not None:
            if value not in values:
                raise _Bad("not an allowed value", ", ".join(map(str, values)))
            value = values[value]
        return {new: value}

    return handler


def _int(value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or int(value) != value or value < 1):  # inf / nan: refused, not an OverflowError from int()
        raise _Bad("not a positive integer", "int >= 1")
    return int(value)


def _total_length(value: Any, get: Getter) -> dict[str, Any]:
    total, prompt = _int(value), get("policy.max_prompt_length")
    if total <= prompt:
        raise _Bad(f"must exceed policy.max_prompt_length={prompt}", f"int > {prompt}")
    return {"policy.rollout.max_new_tokens": total - prompt}


def _num_mini_batches(value: Any, get: Getter) -> dict[str, Any]:
    k, rows = _int(value), get("dataset.train_batch_size") * get("policy.rollout.n")
    if rows % k:
        raise _Bad(f"does not divide the {rows} rows per step", f"a divisor of {rows}")
    return {"policy.train.mini_batch_size": rows // k}


def _kl_coeff(value: Any, get: Getter) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad("not a number", "float >= 0")
    if value == 0:  # no KL term: the coefficient of a term that is off would be refused
        return {"algorithm.use_kl_loss": False}
    return {"algorithm.kl_loss_coef": float(value), "algorithm.use_kl_loss": True}


def _clip_ratio(value: Any, get: Getter) -> dict[str, Any]:
    return {"algorithm.clip_ratio_low": value, "algorithm.clip_ratio_high": value}


def _deep_gemm(value: Any, get: Getter) -> dict[str, Any]:
    if value is False or value is None:
        return {}
    if value is not True:
        raise _Bad("not a bool", "true, false")
    if get("quantization.rollout.precision") != "fp8":
        raise _Bad("DeepGEMM runs FP8 block GEMMs; set quantization.rollout.precision=fp8", "false")
    return {"quantization.rollout.scheme": "fp8_block"}  # LumenRL's own FP8 block GEMMs (Triton)


def _fp8_training(value: Any, get: Getter) -> dict[str, Any]:
    if value in (False, None, "none", "bf16"):
        return {"quantization.training.precision": "bf16"}
    if value not in ("hybrid", "e4m3"):
        raise _Bad("not an allowed value", "hybrid, e4m3, none")
    return {"quantization.training.precision": "fp8", "quantization.training.fp8_format": value}


def _correction_method(value: Any, get: Getter) -> dict[str, Any]:
    modes = {"tis": "tis_token", "mis": "mis_token"}
    if value in (None, "none", False):
        return {"quantization.rollout_correction.enabled": False}
    if value not in modes:
        raise _Bad("not an allowed value", "tis, mis, none")
    return {"quantization.rollout_correction.enabled": True, "quantization.rollout_correction.mode": modes[value]}


def _reward_dataset(value: Any, get: Getter) -> dict[str, Any]:
    if not isinstance(value, str) or not value:
        raise _Bad("not a dataset name or path", "a built-in task name, or a .jsonl/.parquet file")
    for suffix in ("jsonl", "parquet"):
        if value.endswith("." + suffix):
            return {"dataset.name": suffix, "dataset.path": value}
    return {"dataset.name": value}


def _wandb(value: Any, get: Getter) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _Bad("not a bool", "true, false")
    backends = [b for b in get("logger.backends") if b != "wandb"]
    return {"logger.backends": backends + ["wandb"] if value else backends}


def _ray_enabled(value: Any, get: Getter) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _Bad("not a bool", "true, false")
    return {"controller.name": "ray" if value else "local"}


def _new_assembler(value: Any, get: Getter) -> dict[str, Any]:
    if value is not True:
        raise _Bad("there is only one assembler (the strict one); the key is accepted only as true", "true")
    return {}


_FP8_RECIPES = {"blockwise": "blockwise", "block": "blockwise", "tensorwise": "tensorwise",
                "tensor": "tensorwise", "rowwise": "rowwise", "row": "rowwise"}

# original key -> handler; meanings documented in docs/decisions/0010-config-read-or-refused.md
LEGACY: dict[str, Handler] = {
    "policy.generation_backend": _rename("policy.rollout_engine"),
    "policy.max_total_sequence_length": _total_length,
    "policy.train_global_batch_size": _rename("policy.train.mini_batch_size"),
    "policy.train_micro_batch_size": _rename("policy.train.micro_batch_size"),
    "algorithm.grpo.num_generations": _rename("policy.rollout.n"),
    "algorithm.grpo.kl_coeff": _kl_coeff,
    "algorithm.grpo.clip_ratio": _clip_ratio,
    "algorithm.grpo.num_mini_batches": _num_mini_batches,
    "algorithm.grpo.num_ppo_epochs": _rename("policy.train.ppo_epochs"),
    "quantization.rollout.use_deep_gemm": _deep_gemm,
    "quantization.rollout.num_first_layers_in_bf16": _rename("quantization.rollout.skip_first_n_layers"),
    "quantization.rollout.num_last_layers_in_bf16": _rename("quantization.rollout.skip_last_n_layers"),
    "quantization.training.fp8": _fp8_training,
    "quantization.training.fp8_recipe": _rename("quantization.training.recipe", _FP8_RECIPES),
    "quantization.training.fp8_weight_cache": _rename("quantization.training.weight_cache"),
    "quantization.rollout_correction.method": _correction_method,
    "moe.r3.mode": _rename("moe.r3.replay_mode", {"replay": "hard_assignment", "hard_assignment": "hard_assignment",
                                                  "distribution": "distribution"}),
    "reward.type": _rename("reward.name"),
    "reward.dataset": _reward_dataset,
    "checkpointing.checkpoint_dir": _rename("trainer.output_dir"),
    "checkpointing.save_steps": _rename("checkpointing.save_every"),
    "logger.wandb_enabled": _wandb,
    "logger.log_interval": _rename("logger.log_every"),
    "controller.ray.enabled": _ray_enabled,
    "assembly.use_new_assembler": _new_assembler,
}


def is_legacy_key(key: str) -> bool:
    """Whether a dotted override key is an original-LumenRL key (incl. ``controller.ray.<role>.*``)."""
    parts = key.split(".")
    return key in LEGACY or (len(parts) >= 3 and parts[:2] == ["controller", "ray"] and parts[2] not in _RAY_FIELDS)


def _pop(layer: dict[Any, Any], parts: list[str]) -> tuple[bool, Any]:
    node = layer
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False, None
    if parts[-1] not in node:
        return False, None
    value = node.pop(parts[-1])
    _prune(layer, parts[:-1])
    return True, value


def _prune(layer: dict[Any, Any], parts: list[str]) -> None:
    """Drop the now-empty pseudo-sections a legacy key lived in (``algorithm.grpo``)."""
    if parts and parts[-1] == "grpo":
        parent = layer
        for part in parts[:-1]:
            parent = parent[part]
        if parent.get("grpo") == {}:
            del parent["grpo"]


def _set(layer: dict[Any, Any], key: str, value: Any) -> None:
    *head, last = key.split(".")
    for part in head:
        if layer.get(part) is None:
            layer[part] = {}
        if not isinstance(layer[part], dict):
            return  # a section set to a scalar: the build reports it
        layer = layer[part]
    layer[last] = value


def _lookup(data: Mapping[Any, Any], key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return False, None
        data = data[part]
    return True, data


def _ray_roles(layer: dict[Any, Any], notes: list[str]) -> None:
    ray = layer.get("controller", {}).get("ray") if isinstance(layer.get("controller"), dict) else None
    if not isinstance(ray, dict):
        return
    for role in [k for k in ray if k not in _RAY_FIELDS and isinstance(ray[k], dict)]:
        ray.setdefault("roles", {})[role] = ray.pop(role)
        notes.append(f"'controller.ray.{role}' (original LumenRL per-role group) read as controller.ray.roles.{role}")


def translate(layer: dict[Any, Any], current: Mapping[Any, Any], source: str) -> dict[Any, Any]:
    """``layer`` with original-LumenRL keys replaced by current ones (notes logged once per key)."""
    notes: list[str] = []
    layer = copy.deepcopy(layer)
    _ray_roles(layer, notes)
    for key, handler in LEGACY.items():
        found, value = _pop(layer, key.split("."))
        if not found:
            continue

        def get(k: str) -> Any:
            hit, v = _lookup(layer, k)
            return v if hit else _lookup(current, k)[1]

        try:
            try:
                new = handler(value, get)
            except (TypeError, ValueError):  # a related key of the wrong type: reported by the build
                raise _Bad("cannot be read together with the values set so far", "see the related keys") from None
        except _Bad as bad:
            problem, allowed = bad.args
            raise ConfigError(key, value, problem=f"{problem} (original LumenRL key)", allowed=allowed,
                              source=source) from None
        for new_key, new_value in new.items():
            _set(layer, new_key, new_value)
        read_as = ", ".join(f"{k}={v!r}" for k, v in new.items()) or "nothing (no effect here)"
        notes.append(f"{key!r} (original LumenRL key) read as {read_as}")
    for note in notes:
        if note not in _NOTED:
            _NOTED.add(note)
            log.warning("note: %s", note)
    return layer
