"""What every engine shares at construction: the device, the model/tokenizer pair, EOS and pad ids."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["engine_kwargs_from_config", "eos_token_ids", "pad_token_id", "resolve_device", "sliding_window_of"]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def eos_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (may be a list)."""
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return sorted(ids)


def pad_token_id(tokenizer: Any, eos_ids: list[int]) -> int:
    """The tokenizer's pad id, else the first EOS id."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def engine_kwargs_from_config(run_config: Any, model: nn.Module | None, tokenizer: Any) -> dict[str, Any]:
    """What every engine's ``from_config`` passes its constructor: ``model`` and ``tokenizer`` (the
    given objects, else loaded from ``policy``), ``device`` (``cluster.device``), ``max_batch_size``
    (``policy.rollout``) and ``max_seq_len`` (``policy.max_prompt_length`` + ``rollout.max_new_tokens``)."""
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
    return {
        "model": model,
        "tokenizer": tokenizer,
        "device": device,
        "max_batch_size": policy.rollout.max_batch_size,
        "max_seq_len": policy.max_prompt_length + policy.rollout.max_new_tokens,
    }


def sliding_window_of(config: Any) -> tuple[int | None, bool]:
    """(window, mixed): the attention window if any layer uses one, and whether layers mix types."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        return (window if "sliding_attention" in kinds else None), len(kinds) > 1
    if window is not None and getattr(config, "use_sliding_window", True):
        return window, False
    return None, False
