"""``plan_run``: resolve every plugin the config names and check every rule, all at once.

Order of work: config-level rules (no plugins), then each role's plugin (unknown name, cannot
load, incompatible version, unavailable here, allow-list, run features its spec ``requires`` that
the config does not provide), then the capabilities the config
requires of the resolved engine and backend, then model/feature compatibility (R3 and EP on a
dense model). Every problem is collected; with ``assembly.strict_policy`` they are raised
together as one :class:`AssemblyError`, otherwise non-fatal ones become warnings.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from lumenrl_core.assembly.model_kind import is_moe_model, model_type_of, ties_word_embeddings
from lumenrl_core.assembly.plan import AssemblyError, AssemblyWarning, RunPlan, unread_keywords
from lumenrl_core.assembly.requirements import (
    ROLLOUT_SCHEME_BY_PRECISION,
    Violation,
    config_value,
    config_violations,
    required_capabilities,
    rollout_scheme_name,
    unmet_requirements,
)
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.plugins import PluginLoadError, PluginRegistry, get_registry

__all__ = ["plan_run", "assemble"]

_ALLOW_LISTS = {
    "training_backend": "assembly.allowed_training_backends",
    "rollout_engine": "assembly.allowed_inference_backends",
}


def _roles(cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """``(role, kind, config key, plugin name)`` for every plugin the config selects."""
    roles = [
        ("training_backend", "training_backends", "policy.training_backend", cfg.policy.training_backend),
        ("rollout_engine", "rollout_engines", "policy.rollout_engine", cfg.policy.rollout_engine),
        ("adv_estimator", "advantage_estimators", "algorithm.adv_estimator", cfg.algorithm.adv_estimator),
        ("policy_loss", "policy_losses", "algorithm.policy_loss", cfg.algorithm.policy_loss),
        ("controller", "controllers", "controller.name", cfg.controller.name),
        ("trainer", "trainers", "trainer.name", cfg.trainer.name),
        ("weight_sync", "weight_syncs", "weight_sync.method", cfg.weight_sync.method),
    ]
    if not cfg.reward.function:
        roles.append(("reward", "rewards", "reward.name", cfg.reward.name))
    if cfg.quantization.rollout_correction.enabled:
        roles.append(("rollout_correction", "rollout_corrections", "quantization.rollout_correction.mode",
                      cfg.quantization.rollout_correction.mode))
    scheme = rollout_scheme_name(cfg)
    if scheme and cfg.quantization.rollout.precision in ROLLOUT_SCHEME_BY_PRECISION:
        key = "quantization.rollout.scheme" if cfg.quantization.rollout.scheme else "quantization.rollout.precision"
        roles.append(("rollout_quant_scheme", "quant_schemes", key, scheme))
    if cfg.moe.r3.enabled and cfg.moe.r3.router:
        roles.append(("moe_router", "moe_routers", "moe.r3.router", cfg.moe.r3.router))
    roles += [(f"logger:{n}", "loggers", "logger.backends", n) for n in cfg.logger.backends]
    return roles


@dataclass(slots=True)
class _Planner:
    cfg: RunConfig
    registry: PluginRegistry
    load_classes: bool = True
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    classes: dict[str, Any] = field(default_factory=dict)
    caps: dict[str, frozenset[str]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def resolve(self, role: str, kind: str, key: str, name: str) -> None:
        self.names[role], self.keys[role], self.kinds[role] = name, key, kind
        self._check_allow_list(role, key, name)
        if (kind, name) not in self.registry:
            self.violations.append(Violation(key, name, self.registry.unknown_message(kind, name), fatal=True))
            return
        check = self.cfg.assembly.check_plugin_versions
        dist, version = self.registry.distribution(kind, name)
        self.versions[f"{kind}/{name}"] = f"{dist} {version}"
        try:
            if self.load_classes:
                self.classes[role] = self.registry.load(kind, name, check_versions=check)
            else:
                self.registry.spec(kind, name, check_versions=check)  # entry point and version; no class import
        except PluginLoadError as exc:
            self.violations.append(Violation(key, name, f"plugin cannot be loaded: {exc}", fatal=True))
            return
        info = self.registry.info(kind, name, check_versions=check)
        if not info.available:
            self.violations.append(Violation(key, name, f"{kind} plugin unavailable here: {info.reason}"))
        self.caps[role] = info.capabilities
        self.violations.extend(unmet_requirements(self.cfg, kind=kind, name=name, key=key, requires=info.requires,
                                                  package=f"{dist} {version}"))

    def check_keywords(self) -> None:
        """Config values a loaded pure-math plugin would drop (not checked before its class is imported)."""
        for role, cls in self.classes.items():
            self.violations.extend(unread_keywords(self.cfg, role, self.names[role], cls))

    def _check_allow_list(self, role: str, key: str, name: str) -> None:
        allow_key = _ALLOW_LISTS.get(role)
        allowed = config_value(self.cfg, allow_key) if allow_key else None
        if allowed and name not in allowed:
            self.violations.append(Violation(key, name, f"not in {allow_key}; allowed: {', '.join(allowed)}"))

    def check_capabilities(self) -> dict[str, frozenset[str]]:
        required: dict[str, set[str]] = {}
        for need in required_capabilities(self.cfg):
            required.setdefault(need.role, set()).add(need.capability)
            if need.role not in self.caps or need.capability in self.caps[need.role]:
                continue  # unresolved roles were already reported
            role_word = need.role.replace("_", " ")
            self.violations.append(Violation(
                self.keys[need.role], self.names[need.role],
                f"{role_word} lacks capability {need.capability!r} required by "
                f"{need.because_key}={need.because_value!r}; choose a {role_word} that declares it"))
        return {role: frozenset(caps) for role, caps in required.items()}

    def resolve_router_by_model_type(self) -> None:
        """``moe.r3.router`` empty: use the router registered under the model's ``model_type``, if any."""
        cfg = self.cfg
        if not cfg.moe.r3.enabled or cfg.moe.r3.router:
            return
        model_type = model_type_of(cfg.policy.model_name)
        if model_type is None:
            return  # unknown model: check_model says so
        if ("moe_routers", model_type) in self.registry:
            self.resolve("moe_router", "moe_routers", "moe.r3.router", model_type)
        elif is_moe_model(cfg.policy.model_name)[0]:  # a dense model: check_model reports that instead
            self.violations.append(Violation(
                "moe.r3.enabled", True, f"no lumenrl.moe_routers plugin for model_type={model_type!r}: its MoE "
                "block cannot be recorded or replayed; set moe.r3.enabled=false or install a router plugin"))

    def _rollout_quant_option(self, name: str) -> str | None:
        """The config key of the set ``quantization.rollout.<name>`` flag when the rollout is quantized;
        None when the flag is off, or (with a note) when the rollout precision gives it nothing to act on."""
        rq = self.cfg.quantization.rollout
        if not getattr(rq, name):
            return None
        key = f"quantization.rollout.{name}"
        if rq.precision not in ROLLOUT_SCHEME_BY_PRECISION:
            self.notes.append(f"{key}=True has no effect with quantization.rollout.precision={rq.precision!r}")
            return None
        return key

    def check_lm_head(self) -> None:
        """``quantization.rollout.quantize_lm_head`` needs a quantized rollout and an untied head."""
        key = self._rollout_quant_option("quantize_lm_head")
        if key is None:
            return
        tied, how = ties_word_embeddings(self.cfg.policy.model_name)
        if tied:
            self.violations.append(Violation(key, True, (
                f"policy.model_name={self.cfg.policy.model_name!r} ties its output head to the input embeddings "
                f"({how}); weight sync would leave a quantized head stale. Allowed: false for a tied model"),
                fatal=True))
        elif tied is None:
            self.notes.append(f"{key}=True: cannot tell whether policy.model_name={self.cfg.policy.model_name!r} "
                              f"ties its embeddings ({how}); a tied head is refused when the engine loads it")

    def check_fuse_mlp(self) -> None:
        """``quantization.rollout.fuse_mlp`` fuses ``fp8_row`` MLPs only: any other scheme would ignore it."""
        key = self._rollout_quant_option("fuse_mlp")
        if key is None:
            return
        rq = self.cfg.quantization.rollout
        scheme = rq.scheme or ROLLOUT_SCHEME_BY_PRECISION[rq.precision]
        if scheme != "fp8_row":
            self.violations.append(Violation(key, True, (
                f"the fused FP8 SwiGLU MLP needs the fp8_row scheme; quantization.rollout.scheme resolves to "
                f"{scheme!r}. Allowed: false, or quantization.rollout.scheme='fp8_row'")))

    def check_model(self) -> bool | None:
        cfg = self.cfg
        if not (cfg.moe.r3.enabled or cfg.moe.expert_parallel_size > 1):
            return None
        is_moe, how = is_moe_model(cfg.policy.model_name)
        if is_moe is None:
            self.notes.append(f"policy.model_name={cfg.policy.model_name!r}: cannot tell whether it is MoE ({how})")
        elif not is_moe:
            dense = f"needs an MoE model but policy.model_name={cfg.policy.model_name!r} is dense ({how})"
            if cfg.moe.r3.enabled:
                self.violations.append(Violation("moe.r3.enabled", True, dense))
            if cfg.moe.expert_parallel_size > 1:
                self.violations.append(Violation("moe.expert_parallel_size", cfg.moe.expert_parallel_size, dense))
        return is_moe


def _finish(p: _Planner, required: dict[str, frozenset[str]], is_moe: bool | None) -> RunPlan:
    strict = p.cfg.assembly.strict_policy
    errors = [v for v in p.violations if strict or v.fatal]
    if errors:
        raise AssemblyError(errors)
    tolerated = [str(v) for v in p.violations]
    for message in tolerated + p.notes:
        warnings.warn(message, AssemblyWarning, stacklevel=3)
    load_class = functools.partial(p.registry.load, check_versions=p.cfg.assembly.check_plugin_versions)
    return RunPlan(
        config=p.cfg, plugin_names=dict(p.names), plugin_kinds=dict(p.kinds), plugin_versions=dict(p.versions),
        required_capabilities=required, model_is_moe=is_moe, warnings=tuple(tolerated + p.notes),
        classes=dict(p.classes), load_class=load_class,
    )


def plan_run(cfg: RunConfig, *, registry: PluginRegistry | None = None, load_classes: bool = True) -> RunPlan:
    """Resolve and check every plugin ``cfg`` names; raise :class:`AssemblyError` listing all problems.

    Nothing heavy happens here: no model is loaded. Plugins are checked from their specs
    (capabilities, probe); ``load_classes`` also imports every plugin class now, so a class that
    fails to import is one more problem in the list. ``load_classes=False`` (``lumenrl config
    check``) imports none: no torch, and the plan imports each class on first access.
    """
    p = _Planner(cfg=cfg, registry=registry or get_registry(), load_classes=load_classes)
    p.violations.extend(config_violations(cfg))
    for role, kind, key, name in _roles(cfg):
        p.resolve(role, kind, key, name)
    p.resolve_router_by_model_type()
    required = p.check_capabilities()
    p.check_keywords()
    p.check_lm_head()
    p.check_fuse_mlp()
    is_moe = p.check_model()
    return _finish(p, required, is_moe)


def assemble(cfg: RunConfig, *, registry: PluginRegistry | None = None) -> Any:
    """The only way a run is built: :func:`plan_run`, then ``plan.trainer_cls.from_plan(plan)``."""
    plan = plan_run(cfg, registry=registry)
    return plan.trainer_cls.from_plan(plan)
