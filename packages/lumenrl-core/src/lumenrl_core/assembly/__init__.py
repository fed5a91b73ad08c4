"""Strict assembly: turn a :class:`~lumenrl_core.config.schema.RunConfig` into a runnable trainer.

    plan = plan_run(cfg)        # resolves + checks every plugin, raises AssemblyError with ALL problems
    plan_run(cfg, load_classes=False)  # the same checks from the plugins' specs: no class (no torch) imported
    trainer = assemble(cfg)     # plan_run(cfg) then plan.trainer_cls.from_plan(plan)

The rules (see docs/decisions/0001-contracts.md and :mod:`.requirements`): unknown or
unloadable plugins, plugins unavailable here (probe reason), allow-lists, capabilities derived
from the config (FP8/MX rollout, FP8 KV cache, R3, partial rollout, SDDD, FP8 training, expert
parallelism), refused combinations (MX training, PPO without critic/GAE, R3/EP on a dense model), run
features a plugin's spec ``requires`` (GAE: ``critic``; ``task:<dataset.name>``),
the ``reward.function`` syntax, and plugin distribution versions.
"""

from lumenrl_core.assembly.model_kind import config_is_moe, is_moe_model, model_type_of
from lumenrl_core.assembly.plan import (
    AssemblyError,
    AssemblyWarning,
    RunPlan,
    build_with_keywords,
)
from lumenrl_core.assembly.planner import assemble, plan_run
from lumenrl_core.assembly.requirements import (
    ROLLOUT_SCHEME_BY_PRECISION,
    RUN_FEATURES,
    Need,
    Violation,
    check_reward_function,
    config_violations,
    required_capabilities,
    rollout_scheme_name,
    run_features,
    unmet_requirements,
)

__all__ = [
    "plan_run",
    "assemble",
    "RunPlan",
    "AssemblyError",
    "AssemblyWarning",
    "Violation",
    "Need",
    "ROLLOUT_SCHEME_BY_PRECISION",
    "rollout_scheme_name",
    "required_capabilities",
    "config_violations",
    "check_reward_function",
    "RUN_FEATURES",
    "run_features",
    "unmet_requirements",
    "build_with_keywords",
    "config_is_moe",
    "is_moe_model",
    "model_type_of",
]
