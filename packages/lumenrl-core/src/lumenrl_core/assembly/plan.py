"""The result of planning a run: the plugin per role and its class, nothing built yet."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lumenrl_core.assembly.requirements import Violation, config_value
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.rewards import load_reward_function

__all__ = ["AssemblyError", "AssemblyWarning", "RunPlan", "build_with_keywords", "PLUGIN_KEYWORDS",
           "unread_keywords"]

# role -> constructor keyword -> the config key that gives it (RunPlan.build_* pass these to pure-math plugins)
PLUGIN_KEYWORDS: dict[str, dict[str, str]] = {
    "adv_estimator": {"norm_adv_by_std": "algorithm.norm_adv_by_std", "gamma": "algorithm.gamma",
                      "lam": "algorithm.lam"},
    "policy_loss": {"clip_ratio_low": "algorithm.clip_ratio_low", "clip_ratio_high": "algorithm.clip_ratio_high",
                    "clip_ratio_c": "algorithm.clip_ratio_c", "loss_agg_mode": "algorithm.loss_agg_mode",
                    "max_len": "policy.rollout.max_new_tokens"},
    "rollout_correction": {"clip": "quantization.rollout_correction.clip",
                           "extreme_tau": "quantization.rollout_correction.extreme_tau",
                           "mask_low": "quantization.rollout_correction.mask_low",
                           "mask_high": "quantization.rollout_correction.mask_high"},
    "reward": {"format_score": "reward.format_score"},
}
_READ_ELSEWHERE = frozenset({"policy.rollout.max_new_tokens"})  # the engine reads it whatever the loss takes


class AssemblyError(ValueError):
    """The run config violates the assembly policy; ``violations`` lists every problem."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"run config rejected by assembly ({len(self.violations)} problem(s)):\n{lines}")


class AssemblyWarning(UserWarning):
    """A policy violation tolerated because ``assembly.strict_policy`` is false."""


def build_with_keywords(cls: Any, candidates: Mapping[str, Any]) -> Any:
    """``cls(**kw)`` with the ``candidates`` it uses: its ``config_keywords`` if declared, else those its
    constructor accepts (all of them if it takes ``**kwargs``). A set value it drops is refused at planning
    (:func:`unread_keywords`)."""
    accepted = _accepted(cls)
    return cls(**{k: v for k, v in candidates.items() if accepted is None or k in accepted})


def _accepted(cls: Any) -> frozenset[str] | None:
    """The keywords ``cls`` uses: its ``config_keywords`` if it declares them (a class whose fields are shared
    by modes that read different ones), else its constructor's parameters; None: any (``**kwargs``)."""
    declared = getattr(cls, "config_keywords", None)
    if declared is not None:
        return frozenset(declared)
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def unread_keywords(cfg: RunConfig, role: str, name: str, cls: Any) -> list[Violation]:
    """A violation per config key of :data:`PLUGIN_KEYWORDS` set away from its default that the plugin filling
    ``role`` does not take: built with :func:`build_with_keywords`, it would drop the value silently."""
    accepted = _accepted(cls)
    if accepted is None or role not in PLUGIN_KEYWORDS:
        return []
    default, out = RunConfig(), []
    for keyword, key in PLUGIN_KEYWORDS[role].items():
        value = config_value(cfg, key)
        if keyword in accepted or key in _READ_ELSEWHERE or value == config_value(default, key):
            continue
        out.append(Violation(key, value, f"has no effect: the {role.replace('_', ' ')} plugin {name!r} takes no "
                                         f"{keyword!r}; allowed: {config_value(default, key)!r} (the default), or "
                                         "a plugin that takes it"))
    return out


def _keywords(cfg: RunConfig, role: str, drop_none: tuple[str, ...] = ()) -> dict[str, Any]:
    """``PLUGIN_KEYWORDS[role]`` with the config's values (those in ``drop_none`` left out while unset)."""
    values = {kw: config_value(cfg, key) for kw, key in PLUGIN_KEYWORDS[role].items()}
    return {kw: v for kw, v in values.items() if not (kw in drop_none and v is None)}


class _RoleClass:
    """``plan.<role>_cls``: the class of the plugin filling ``<role>`` (see :meth:`RunPlan.class_of`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.role = name.removesuffix("_cls")

    def __get__(self, plan: RunPlan | None, owner: type | None = None) -> Any:
        return self if plan is None else plan.class_of(self.role)


@dataclass(kw_only=True, slots=True)
class RunPlan:
    """Everything :func:`~lumenrl_core.assembly.assemble` resolved: the plugin per role, its class.

    ``plan.<role>_cls`` is the plugin class of a role (``None`` for a role the config leaves
    empty); a class :func:`~lumenrl_core.assembly.plan_run` did not import (``load_classes=False``,
    what ``lumenrl config check`` uses) is imported through the registry on first access.

    Pure-math plugins are built with :meth:`build_adv_estimator` & co., which map config fields
    to the keywords their constructors accept (the contract of docs/decisions/0001). Plugins that
    read the run config are built by the trainer with ``Cls.from_config(plan.config)``.
    """

    config: RunConfig
    plugin_names: dict[str, str] = field(default_factory=dict)  # role -> plugin name
    plugin_kinds: dict[str, str] = field(default_factory=dict)  # role -> plugin kind
    plugin_versions: dict[str, str] = field(default_factory=dict)  # "kind/name" -> "distribution version"
    required_capabilities: dict[str, frozenset[str]] = field(default_factory=dict)  # role -> caps
    model_is_moe: bool | None = None
    warnings: tuple[str, ...] = ()
    classes: dict[str, type] = field(default_factory=dict)  # role -> plugin class, imported so far
    load_class: Callable[[str, str], type] | None = None  # (kind, name) -> class: the registry's load

    training_backend_cls = _RoleClass()
    rollout_engine_cls = _RoleClass()
    adv_estimator_cls = _RoleClass()
    policy_loss_cls = _RoleClass()
    rollout_correction_cls = _RoleClass()
    rollout_quant_scheme_cls = _RoleClass()
    reward_cls = _RoleClass()  # None when reward.function names a user function
    controller_cls = _RoleClass()
    trainer_cls = _RoleClass()
    weight_sync_cls = _RoleClass()
    moe_router_cls = _RoleClass()

    def class_of(self, role: str) -> type | None:
        """The plugin class filling ``role``, imported on first use; ``None`` if no plugin fills it.

        Raises :class:`~lumenrl_core.plugins.PluginLoadError` when the class cannot be imported."""
        if role not in self.plugin_names:
            return None
        if role not in self.classes:
            if self.load_class is None:
                raise LookupError(f"RunPlan has no class for role {role!r} and no load_class to import it")
            self.classes[role] = self.load_class(self.plugin_kinds[role], self.plugin_names[role])
        return self.classes[role]

    @property
    def logger_classes(self) -> dict[str, type]:
        """Logger name -> class, in config order."""
        return {role.split(":", 1)[1]: self.class_of(role) for role in self.plugin_names if role.startswith("logger:")}

    def version_of(self, role: str) -> str:
        """``"distribution version"`` of the plugin filling ``role`` (e.g. ``"rollout_engine"``)."""
        return self.plugin_versions[f"{self.plugin_kinds[role]}/{self.plugin_names[role]}"]

    def build_adv_estimator(self) -> Any:
        return build_with_keywords(self.adv_estimator_cls, _keywords(self.config, "adv_estimator"))

    def build_policy_loss(self) -> Any:
        return build_with_keywords(self.policy_loss_cls, _keywords(self.config, "policy_loss"))

    def build_rollout_correction(self) -> Any | None:
        if self.rollout_correction_cls is None:
            return None
        # an unset band: the mode's own default
        return build_with_keywords(self.rollout_correction_cls,
                                   _keywords(self.config, "rollout_correction", drop_none=("mask_low", "mask_high")))

    def build_reward(self) -> Any:
        """The reward callable: the user's function, or the named reward plugin instance."""
        if self.config.reward.function:
            return load_reward_function(self.config.reward.function)
        return build_with_keywords(self.reward_cls, _keywords(self.config, "reward"))

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary for run records: plugin per role with versions."""
        return {
            "plugins": dict(self.plugin_names),
            "plugin_versions": dict(self.plugin_versions),
            "required_capabilities": {k: sorted(v) for k, v in self.required_capabilities.items()},
            "model_is_moe": self.model_is_moe,
            "warnings": list(self.warnings),
        }
