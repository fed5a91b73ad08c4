"""TIS / MIS rollout correction: pure tensor functions, metrics and registered plugins.

See :mod:`lumenrl_quant.correction.functional` for the formulas and conventions.
"""

from lumenrl_quant.correction.exact_kl import train_rollout_kl
from lumenrl_quant.correction.functional import (
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    apply_is_weights,
    kl_estimate,
    kl_rejection_mask,
    mis_geometric_mask,
    mis_sequence_mask,
    mis_token_mask,
    rollout_log_ratio,
    seq_mis,
    tis_sequence_weights,
    tis_token_weights,
)
from lumenrl_quant.correction.metrics import METRIC_PREFIX, rollout_correction_metrics
from lumenrl_quant.correction.plugins import (
    MISGeometric,
    MISSequence,
    MISToken,
    SeqMIS,
    TISSequence,
    TISToken,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "METRIC_PREFIX",
    "MISGeometric",
    "MISSequence",
    "MISToken",
    "SeqMIS",
    "TISSequence",
    "TISToken",
    "apply_is_weights",
    "kl_estimate",
    "kl_rejection_mask",
    "mis_geometric_mask",
    "mis_sequence_mask",
    "mis_token_mask",
    "rollout_correction_metrics",
    "rollout_log_ratio",
    "seq_mis",
    "tis_sequence_weights",
    "tis_token_weights",
    "train_rollout_kl",
]
