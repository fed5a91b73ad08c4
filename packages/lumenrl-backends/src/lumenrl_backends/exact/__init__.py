"""Bitwise on-policy mode (``policy.rollout.exact_logprobs``): batch-invariant operators shared by
the native engine and the training backend; see :mod:`~lumenrl_backends.exact.ops`."""

from lumenrl_backends.exact.attention import ATTN_NAME, exact_attention
from lumenrl_backends.exact.ops import exact_linear, exact_rms_norm, exact_token_log_probs
from lumenrl_backends.exact.patch import (
           check_engine_settings,
           enable_exact,
           enable_exact_quantized,
           exact_actor,
           is_exact,
)

EXACT_BACKEND = ATTN_NAME  # the training log-prob "backend" name of the exact log-softmax (training.modeling)

__all__ = ["ATTN_NAME", "EXACT_BACKEND", "check_engine_settings", "enable_exact", "enable_exact_quantized", "exact_actor",
           "exact_attention",
           "exact_linear", "exact_rms_norm", "exact_token_log_probs", "is_exact"]
