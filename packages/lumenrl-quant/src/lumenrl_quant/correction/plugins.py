"""Rollout-correction plugins registered under the ``lumenrl.rollout_corrections`` entry-point group.

Each class satisfies lumenrl-core's ``RolloutCorrection`` protocol structurally (this package
never imports core): ``capabilities`` and a classmethod ``probe()`` (both from the plugin's spec in
:mod:`lumenrl_quant.plugin_manifest`), and

    __call__(old_log_probs, rollout_log_probs, mask) -> (is_weights | None, keep_mask, metrics)

All classes take the same keywords (the fields of core's ``RolloutCorrectionConfig`` minus
``enabled`` / ``mode``, plus optional KL rejection) so an assembler can build any of them from one
config; ``config_keywords`` names those a mode uses, and a class refuses (``ValueError``) one of the others
set away from its default, as well as ``reject_kl_threshold`` set while ``reject_kl`` is None:

- ``clip``: TIS cap C (``tis_token``, ``tis_seq``);
- ``mask_low`` / ``mask_high``: MIS band (``mis_*``, ``seq_mis``);
- ``extreme_tau``: threshold of the ``extreme_token_frac`` metric;
- ``reject_kl`` (``None`` | "k1" | "k2" | "k3") and ``reject_kl_threshold``: additionally reject
  rows whose mean KL(rollout || train) estimate exceeds the threshold (any mode).

Rejected tokens get weight 0 and keep 0; padding is always 0 in both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from lumenrl_quant import plugin_manifest as manifest
from lumenrl_quant.correction.functional import (
    KL_ESTIMATORS,
    kl_rejection_mask,
    mis_geometric_mask,
    mis_sequence_mask,
    mis_token_mask,
    rollout_log_ratio,
    seq_mis,
    tis_sequence_weights,
    tis_token_weights,
)
from lumenrl_quant.correction.metrics import rollout_correction_metrics

__all__ = ["TISToken", "TISSequence", "MISToken", "MISSequence", "MISGeometric", "SeqMIS"]

_Result = tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]
_Parts = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]  # weights, keep, clipped


@dataclass(kw_only=True, slots=True)
class _RolloutCorrectionBase:
    clip: float = 2.0  # TIS cap C
    mask_low: float = 0.5  # MIS band low
    mask_high: float = 2.0  # MIS band high
    extreme_tau: float = 2.0  # extreme-token threshold on max(r, 1/r)
    reject_kl: str | None = None  # optional KL rejection: "k1" | "k2" | "k3"
    reject_kl_threshold: float = math.inf  # reject rows with mean KL estimate above this

    plugin_spec: ClassVar[manifest.Spec]  # each mode's spec in lumenrl_quant.plugin_manifest
    capabilities: ClassVar[frozenset[str]] = frozenset()
    config_keywords: ClassVar[frozenset[str]] = frozenset({"extreme_tau", "reject_kl", "reject_kl_threshold"})

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0; got {self.clip!r}")
        if not 0.0 <= self.mask_low <= self.mask_high:
            raise ValueError(
                f"mask_low / mask_high must satisfy 0 <= low <= high; got {self.mask_low!r}, {self.mask_high!r}"
            )
        if not self.extreme_tau >= 1.0:
            raise ValueError(f"extreme_tau must be >= 1; got {self.extreme_tau!r}")
        if self.reject_kl is not None and self.reject_kl not in KL_ESTIMATORS:
            raise ValueError(f"reject_kl must be None or one of {KL_ESTIMATORS}; got {self.reject_kl!r}")
        # a field set away from this class's default that its mode does not read would be validated and ignored
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, default in defaults.items():
            value = getattr(self, name)
            if name not in self.config_keywords and value != default:
                raise ValueError(f"{name}={value!r} has no effect on {type(self).__name__}; allowed: {default!r} (the "
                                 f"default), or a mode that reads it (this one reads {sorted(self.config_keywords)})")
        if self.reject_kl is None and self.reject_kl_threshold != defaults["reject_kl_threshold"]:
            raise ValueError(f"reject_kl_threshold={self.reject_kl_threshold!r} has no effect with reject_kl=None; "
                             f"allowed: {defaults['reject_kl_threshold']!r} (the default), or reject_kl one of "
                             f"{KL_ESTIMATORS}")

    @classmethod
    def probe(cls) -> str | None:
        return cls.plugin_spec.unavailable_reason()  # pure torch: always available

    def __call__(
        self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
    ) -> _Result:
        weights, keep, clipped = self._correct(old_log_probs, rollout_log_probs, mask)
        if self.reject_kl is not None:
            kl_keep = kl_rejection_mask(
                old_log_probs,
                rollout_log_probs,
                mask,
                estimator=self.reject_kl,
                threshold=self.reject_kl_threshold,
            )
            keep = keep * kl_keep
        if weights is not None:
            weights = torch.where(keep != 0, weights, torch.zeros_like(weights))
        metrics = rollout_correction_metrics(
            old_log_probs,
            rollout_log_probs,
            mask,
            is_weights=weights,
            keep_mask=keep,
            clipped=clipped,
            extreme_tau=self.extreme_tau,
        )
        return weights, keep, metrics

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        raise NotImplementedError


def _sequence_exceeds(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    log_ratio = rollout_log_ratio(old, rollout, mask)
    seq = log_ratio.sum(dim=-1, keepdim=True) > math.log(cap)  # (B, 1)
    return seq & (mask != 0)


@dataclass(kw_only=True, slots=True)
class TISToken(_RolloutCorrectionBase):
    """Token TIS: ``w_t = min(r_t, clip)``; nothing rejected."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.TIS_TOKEN
    capabilities: ClassVar[frozenset[str]] = manifest.TIS_TOKEN.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"clip"}

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        weights = tis_token_weights(old, rollout, mask, clip=self.clip)
        clipped = (rollout_log_ratio(old, rollout, mask) > math.log(self.clip)) & (mask != 0)
        return weights, mask.clone(), clipped


@dataclass(kw_only=True, slots=True)
class TISSequence(_RolloutCorrectionBase):
    """Sequence TIS: ``w = min(exp(sum_t log r_t), clip)`` for every token of the row."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.TIS_SEQ
    capabilities: ClassVar[frozenset[str]] = manifest.TIS_SEQ.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"clip"}

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        weights = tis_sequence_weights(old, rollout, mask, clip=self.clip)
        return weights, mask.clone(), _sequence_exceeds(old, rollout, mask, self.clip)


@dataclass(kw_only=True, slots=True)
class MISToken(_RolloutCorrectionBase):
    """Token MIS: reject tokens whose ratio leaves ``[mask_low, mask_high]``; no weights."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.MIS_TOKEN
    capabilities: ClassVar[frozenset[str]] = manifest.MIS_TOKEN.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"mask_low", "mask_high"}

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        return None, mis_token_mask(old, rollout, mask, low=self.mask_low, high=self.mask_high), None


@dataclass(kw_only=True, slots=True)
class MISSequence(_RolloutCorrectionBase):
    """Sequence MIS: reject rows whose product ratio leaves ``[mask_low, mask_high]``; no weights."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.MIS_SEQ
    capabilities: ClassVar[frozenset[str]] = manifest.MIS_SEQ.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"mask_low", "mask_high"}

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        return None, mis_sequence_mask(old, rollout, mask, low=self.mask_low, high=self.mask_high), None


@dataclass(kw_only=True, slots=True)
class MISGeometric(_RolloutCorrectionBase):
    """Geometric-mean MIS: reject rows whose per-token geometric-mean ratio leaves a tight band."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.MIS_GEO
    capabilities: ClassVar[frozenset[str]] = manifest.MIS_GEO.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"mask_low", "mask_high"}

    mask_low: float = 0.999
    mask_high: float = 1.001

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        return None, mis_geometric_mask(old, rollout, mask, low=self.mask_low, high=self.mask_high), None


@dataclass(kw_only=True, slots=True)
class SeqMIS(_RolloutCorrectionBase):
    """Seq-MIS: sequence IS weights, rows with ratio outside ``[mask_low, mask_high]`` rejected."""

    plugin_spec: ClassVar[manifest.Spec] = manifest.SEQ_MIS
    capabilities: ClassVar[frozenset[str]] = manifest.SEQ_MIS.capabilities
    config_keywords: ClassVar[frozenset[str]] = _RolloutCorrectionBase.config_keywords | {"mask_low", "mask_high"}

    def _correct(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> _Parts:
        weights, keep = seq_mis(old, rollout, mask, low=self.mask_low, high=self.mask_high)
        return weights, keep, None
