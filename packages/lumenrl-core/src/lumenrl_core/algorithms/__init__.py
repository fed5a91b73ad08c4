"""RL algorithm math: advantages, policy/value losses, KL, loss aggregation, DAPO shaping.

Everything here is a pure function on (B, T) tensors with a response mask; the plugin classes
(``GRPOAdvantage``, ``PPOClipLoss``, ...) are thin adapters registered under
``lumenrl.advantage_estimators`` / ``lumenrl.policy_losses``.
"""

from lumenrl_core.algorithms.advantages import (
    DrGRPOAdvantage,
    GAEAdvantage,
    GRPOAdvantage,
    RLOOAdvantage,
    drgrpo_outcome_advantage,
    gae_advantage,
    grpo_outcome_advantage,
    outcome_scores,
    rloo_outcome_advantage,
)
from lumenrl_core.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs
from lumenrl_core.algorithms.dapo import (
    DynamicSamplingState,
    apply_overlong_penalty,
    dynamic_sampling_keep_indices,
    overlong_penalty,
)
from lumenrl_core.algorithms.kl import KL_KINDS, apply_kl_penalty, kl_estimate, kl_loss
from lumenrl_core.algorithms.logits import entropy_from_logits, log_probs_from_logits
from lumenrl_core.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from lumenrl_core.algorithms.policy_loss import PPOClipLoss, ppo_clip_loss, ppo_clip_token_loss
from lumenrl_core.algorithms.value_loss import clipped_value_loss

__all__ = [
    "DrGRPOAdvantage",
    "GAEAdvantage",
    "GRPOAdvantage",
    "RLOOAdvantage",
    "drgrpo_outcome_advantage",
    "gae_advantage",
    "grpo_outcome_advantage",
    "outcome_scores",
    "rloo_outcome_advantage",
    "LOSS_AGG_MODES",
    "agg_loss",
    "count_tokens_and_seqs",
    "DynamicSamplingState",
    "apply_overlong_penalty",
    "dynamic_sampling_keep_indices",
    "overlong_penalty",
    "KL_KINDS",
    "apply_kl_penalty",
    "kl_estimate",
    "kl_loss",
    "entropy_from_logits",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "PPOClipLoss",
    "ppo_clip_loss",
    "ppo_clip_token_loss",
    "clipped_value_loss",
]
