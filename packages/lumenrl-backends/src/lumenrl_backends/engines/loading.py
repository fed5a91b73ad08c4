"""What every engine's ``from_config`` shares: the device and the model/tokenizer pair."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["engine_model_from_config"]


def engine_model_from_config(
    run_config: Any, model: nn.Module | None, tokenizer: Any
) -> tuple[nn.Module, Any, torch.device]:
    """``(model, tokenizer, device)`` for an engine: the given objects, else loaded from ``policy``."""
    from lumenrl_backends.engines.native import resolve_device
    from lumenrl_backends.models import load_model_and_tokenizer

    policy = run_config.policy
    device = resolve_device(run_config.cluster.device)
    if model is None or tokenizer is None:
        loaded_model, loaded_tokenizer = load_model_and_tokenizer(
            policy.model_name,
            dtype=policy.dtype,
            device=device,
            tokenizer_name=policy.tokenizer_name,
            trust_remote_code=policy.trust_remote_code,
        )
        model, tokenizer = model or loaded_model, tokenizer or loaded_tokenizer
    return model, tokenizer, device
