"""Tiny configurations of every supported model family, for tests and the built-in demo.

Each family is built from ``AutoConfig.for_model(model_type, ...)`` with real architecture code
(no stand-ins), so a tiny model exercises the same modules, cache calls and weight names as the
full-size checkpoint. Sizes: hidden 64, 2 layers (MoE families: one dense + one MoE layer where
the architecture has dense-first layers), 4 query heads, 2 KV heads, 4 experts with top-2
routing. The vocabulary comes from :func:`build_char_tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lumenrl_backends.models.tokenizer import build_char_tokenizer

__all__ = ["FAMILIES", "tiny_config", "build_tiny_model"]

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 16},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {**_MOE, "head_dim": 16, "num_local_experts": 4, "norm_topk_prob": True},
    "mixtral": {"head_dim": 16, "num_experts_per_tok": 2, "num_local_experts": 4},
    "deepseek_v3": {
        **_MOE,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "num_nextn_predict_layers": 0,
    },
    "glm4_moe": {
        **_MOE,
        "head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0,
    },
}

FAMILIES: tuple[str, ...] = tuple(_FAMILY_OVERRIDES)


def _check_family(family: str) -> None:
    if family not in _FAMILY_OVERRIDES:
        raise ValueError(f"family={family!r} is not supported; choose one of {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A tiny ``AutoConfig`` of ``family`` whose vocabulary matches the char tokenizer.

    ``overrides`` replace any field (e.g. ``num_hidden_layers=4``).
    """
    _check_family(family)
    tokenizer = build_char_tokenizer()
    fields: dict[str, Any] = {
        **_COMMON,
        **_FAMILY_OVERRIDES[family],
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    # an override may use an alias of a default's field (qwen3_moe: num_experts -> num_local_experts): the
    # canonical name takes it, or the default would win over the caller's value
    from transformers import CONFIG_MAPPING

    aliases = getattr(CONFIG_MAPPING[family], "attribute_map", {})
    fields.update({aliases.get(key, key): value for key, value in overrides.items()})
    return AutoConfig.for_model(family, **fields)


def build_tiny_model(
    family: str, path: str | os.PathLike[str], seed: int = 0, **overrides: Any
) -> Path:
    """Build a randomly initialised tiny ``family`` model and save model + tokenizer to ``path``.

    Initialisation is seeded (``seed``) without touching the global RNG state. Returns ``path``.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(target)
    build_char_tokenizer().save_pretrained(target)
    return target
