"""Swap a model's ``nn.Linear`` layers for :class:`Fp8TrainingLinear`, and keep weight caches fresh.

Only exact ``nn.Linear`` modules are converted (a subclass may override ``forward``); each one
that is not converted is listed in the returned report with the reason. Layers keep their own
Parameter objects, so an optimizer built before or after conversion works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lumenrl_quant.training.linear import Fp8TrainingLinear
from lumenrl_quant.training.recipes import Fp8TrainingConfig

__all__ = [
    "Fp8ConversionReport",
    "attach_weight_cache_invalidation",
    "convert_to_fp8_training",
    "invalidate_fp8_weight_caches",
]

ModuleFilter = Callable[[str, nn.Module], bool]


@dataclass(kw_only=True, slots=True)
class Fp8ConversionReport:
    """What :func:`convert_to_fp8_training` did: converted module names, skipped ones with why."""

    config: Fp8TrainingConfig
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [
            f"FP8 training ({self.config.recipe}, {self.config.fp8_format}): {len(self.converted)} converted"
        ]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _skip_reason(
    fqn: str,
    module: nn.Module,
    config: Fp8TrainingConfig,
    module_filter: ModuleFilter | None,
    min_features: int,
) -> str | None:
    if isinstance(module, Fp8TrainingLinear):
        return "already an Fp8TrainingLinear"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} subclasses nn.Linear (its forward may differ); not converted"
    if not fqn:
        return "the root module cannot be swapped in place; convert a parent module"
    if module_filter is not None and not module_filter(fqn, module):
        return "excluded by module_filter"
    k, n = module.in_features, module.out_features
    if min(k, n) < min_features:
        return f"in_features={k}, out_features={n}: smaller than min_features={min_features}"
    multiple = config.dim_multiple
    if k % multiple or n % multiple:
        return f"in_features={k}, out_features={n}: recipe {config.recipe!r} needs multiples of {multiple}"
    return None


def convert_to_fp8_training(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    fp8_format: str = "hybrid",
    weight_cache: bool = True,
    module_filter: ModuleFilter | None = None,
    min_features: int = 16,
    fnuz: bool | None = None,
) -> Fp8ConversionReport:
    """Swap, in place, every eligible ``nn.Linear`` of ``model`` for an :class:`Fp8TrainingLinear`.

    ``module_filter(fqn, module) -> bool`` may exclude layers (e.g. the LM head); layers with
    ``min(in, out) < min_features`` or dims not multiples of 16 (128 for ``blockwise``) are
    skipped. Call :func:`attach_weight_cache_invalidation` on the optimizer when ``weight_cache``.
    """
    config = Fp8TrainingConfig(recipe=recipe, fp8_format=fp8_format, weight_cache=weight_cache, fnuz=fnuz)
    if min_features < 0:
        raise ValueError(f"min_features must be >= 0; got {min_features!r}")
    report = Fp8ConversionReport(config=config)
    swapped: dict[int, nn.Module] = {}  # id(old linear) -> replacement (a module shared under 2 names)
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, nn.Linear):
            continue
        if id(module) in swapped:
            model.set_submodule(fqn, swapped[id(module)])
            report.converted.append(fqn)
            continue
        reason = _skip_reason(fqn, module, config, module_filter, min_features)
        if reason is not None:
            report.skipped[fqn or "<root>"] = reason
            continue
        swapped[id(module)] = Fp8TrainingLinear.from_linear(module, config)
        model.set_submodule(fqn, swapped[id(module)])
        report.converted.append(fqn)
    return report


def invalidate_fp8_weight_caches(model: nn.Module) -> int:
    """Drop every cached FP8 weight in ``model``; returns the number of layers touched."""
    layers = [m for m in model.modules() if isinstance(m, Fp8TrainingLinear)]
    for layer in layers:
        layer.invalidate_weight_cache()
    return len(layers)


def attach_weight_cache_invalidation(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """Invalidate ``model``'s FP8 weight caches after every ``optimizer.step()``.

    Uses ``optimizer.register_step_post_hook``; the returned handle's ``remove()`` detaches it.
    """

    def _after_step(_optimizer, _args, _kwargs) -> None:
        invalidate_fp8_weight_caches(model)

    return optimizer.register_step_post_hook(_after_step)
