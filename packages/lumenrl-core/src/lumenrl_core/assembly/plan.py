"""The result of planning a run: resolved plugin classes per role, nothing built yet."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lumenrl_core.assembly.requirements import Violation
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.rewards import load_reward_function

__all__ = ["AssemblyError", "AssemblyWarning", "RunPlan", "build_with_keywords"]


class AssemblyError(ValueError):
    """The run config violates the assembly policy; ``violations`` lists every problem."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"run config rejected by assembly ({len(self.violations)} problem(s)):\n{lines}")


class AssemblyWarning(UserWarning):
    """A policy violation tolerated because ``assembly.strict_policy`` is false."""


def build_with_keywords(cls: Any, candidates: Mapping[str, Any]) -> Any:
    """``cls(**kw)`` with the ``candidates`` its constructor accepts (all of them if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return cls(**candidates)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return cls(**candidates)
    accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return cls(**{k: v for k, v in candidates.items() if k in accepted})


@dataclass(kw_only=True, slots=True)
class RunPlan:
    """Everything :func:`~lumenrl_core.assembly.assemble` resolved; classes, not instances.

    Pure-math plugins are built with :meth:`build_adv_estimator` & co., which map config fields
    to the keywords their constructors accept (the contract of docs/decisions/0001). Plugins that
    read the run config are built by the trainer with ``Cls.from_config(plan.config)``.
    """

    config: RunConfig
    training_backend_cls: type
    rollout_engine_cls: type
    adv_estimator_cls: type
    policy_loss_cls: type
    rollout_correction_cls: type | None = None
    rollout_quant_scheme_cls: type | None = None
    reward_cls: type | None = None  # None when reward.function names a user function
    controller_cls: type
    trainer_cls: type
    logger_classes: dict[str, type] = field(default_factory=dict)  # logger name -> class, in config order
    weight_sync_cls: type
    moe_router_cls: type | None = None
    plugin_names: dict[str, str] = field(default_factory=dict)  # role -> plugin name
    plugin_kinds: dict[str, str] = field(default_factory=dict)  # role -> plugin kind
    plugin_versions: dict[str, str] = field(default_factory=dict)  # "kind/name" -> "distribution version"
    required_capabilities: dict[str, frozenset[str]] = field(default_factory=dict)  # role -> caps
    model_is_moe: bool | None = None
    warnings: tuple[str, ...] = ()

    def version_of(self, role: str) -> str:
        """``"distribution version"`` of the plugin filling ``role`` (e.g. ``"rollout_engine"``)."""
        return self.plugin_versions[f"{self.plugin_kinds[role]}/{self.plugin_names[role]}"]

    def build_adv_estimator(self) -> Any:
        a = self.config.algorithm
        return build_with_keywords(self.adv_estimator_cls, {
            "norm_adv_by_std": a.norm_adv_by_std, "gamma": a.gamma, "lam": a.lam})

    def build_policy_loss(self) -> Any:
        a = self.config.algorithm
        return build_with_keywords(self.policy_loss_cls, {
            "clip_ratio_low": a.clip_ratio_low, "clip_ratio_high": a.clip_ratio_high,
            "clip_ratio_c": a.clip_ratio_c, "loss_agg_mode": a.loss_agg_mode,
            "max_len": self.config.policy.rollout.max_new_tokens})

    def build_rollout_correction(self) -> Any | None:
        if self.rollout_correction_cls is None:
            return None
        c = self.config.quantization.rollout_correction
        band = {k: v for k, v in (("mask_low", c.mask_low), ("mask_high", c.mask_high)) if v is not None}
        return build_with_keywords(self.rollout_correction_cls, {
            "clip": c.clip, "extreme_tau": c.extreme_tau, **band})  # unset band: the mode's own default

    def build_reward(self) -> Any:
        """The reward callable: the user's function, or the named reward plugin instance."""
        if self.config.reward.function:
            return load_reward_function(self.config.reward.function)
        return build_with_keywords(self.reward_cls, {"format_score": self.config.reward.format_score})

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary for run records: plugin per role with versions."""
        return {
            "plugins": dict(self.plugin_names),
            "plugin_versions": dict(self.plugin_versions),
            "required_capabilities": {k: sorted(v) for k, v in self.required_capabilities.items()},
            "model_is_moe": self.model_is_moe,
            "warnings": list(self.warnings),
        }
