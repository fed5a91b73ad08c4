"""Is a model a Mixture-of-Experts? Decided from its ``config.json`` when one is on local disk
(a checkpoint directory, or the Hugging Face cache), else from well-known names. Never loads
weights and never touches the network.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["MOE_MODEL_TYPES", "config_is_moe", "find_local_config", "is_moe_model", "model_type_of",
           "ties_word_embeddings"]

MOE_MODEL_TYPES = frozenset({
    "qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe",
    "olmoe", "gpt_oss", "dbrx", "jamba", "granitemoe", "phimoe", "llama4", "minimax", "ernie4_5_moe",
})
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# Hub ids of MoE families whose names do not say "moe": Qwen3-30B-A3B, DeepSeek-V3, gpt-oss, ...
_MOE_NAME = re.compile(
    r"moe|mixtral|-a\d+(\.\d+)?b\b|deepseek-(v2|v3|r1)|glm-4\.[56]|gpt-oss|dbrx|jamba|llama-4", re.IGNORECASE
)


def config_is_moe(config: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict (or its ``text_config``) describes an MoE model."""
    for section in (config, config.get("text_config") or {}):
        if section.get("model_type") in MOE_MODEL_TYPES:
            return True
        for key in _EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 1:
                return True
    return False


def _hf_cache_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - malformed ids raise validation errors
        return None
    return Path(found) if isinstance(found, str) else None


def _builtin_cache_config(model_name: str) -> Path | None:
    """A built-in ``lumenrl:<name>`` already materialised under ``$LUMENRL_CACHE/<name>/<key>``.

    The key (which hashes the building code) is computed by lumenrl-backends; here the newest
    complete build (one with its ``lumenrl-build.json`` manifest) stands for the model's shape.
    """
    root = os.environ.get("LUMENRL_CACHE") or os.path.join("~", ".cache", "lumenrl", "models")
    base = Path(root).expanduser() / model_name.removeprefix("lumenrl:")
    found = [p / "config.json" for p in base.glob("*") if (p / "lumenrl-build.json").is_file()]
    found = [p for p in found if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def find_local_config(model_name: str) -> Path | None:
    """The ``config.json`` for ``model_name`` if it exists locally (directory, built-in cache, HF cache)."""
    if model_name.startswith("lumenrl:"):
        return _builtin_cache_config(model_name)
    path = Path(os.path.expanduser(model_name))
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.name == "config.json":
        return path
    if model_name.count("/") != 1:
        return None
    return _hf_cache_config(model_name)


def _read_config(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(config, "")`` from a ``config.json``, or ``(None, why it cannot be read)``."""
    try:
        return json.loads(path.read_text()), ""
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"


def _builtin_name(model_name: str) -> str:
    """``lumenrl:tiny-qwen3-moe`` -> ``tiny-qwen3-moe``: built-ins are named tiny-<family>[-task]."""
    return model_name.removeprefix("lumenrl:").lower()


def is_moe_model(model_name: str) -> tuple[bool | None, str]:
    """``(is_moe, how_decided)``; ``is_moe`` is ``None`` when it cannot be told without downloading."""
    config_path = find_local_config(model_name)
    if config_path is not None:
        config, error = _read_config(config_path)
        return (None, error) if config is None else (config_is_moe(config), f"from {config_path}")
    if model_name.startswith("lumenrl:"):  # the family in the built-in's name says it
        short = _builtin_name(model_name)
        return "moe" in short or any(t in short for t in MOE_MODEL_TYPES), "built-in model name"
    if _MOE_NAME.search(model_name):
        return True, "known MoE model family"
    return None, "no local config.json and not a known MoE family"


def model_type_of(model_name: str) -> str | None:
    """HF ``model_type`` of ``model_name`` from a local ``config.json``, else from a built-in's family name."""
    config_path = find_local_config(model_name)
    if config_path is not None:
        config, _ = _read_config(config_path)
        if config is None:
            return None
        return (config.get("text_config") or {}).get("model_type") or config.get("model_type")
    if model_name.startswith("lumenrl:"):
        short = _builtin_name(model_name)
        found = [t for t in MOE_MODEL_TYPES if t in short]
        return max(found, key=len) if found else None
    return None


def ties_word_embeddings(model_name: str) -> tuple[bool | None, str]:
    """``(tied, how_decided)``: whether the output head shares the input embedding's weight, from
    ``tie_word_embeddings`` in a local ``config.json`` (or its ``text_config``); ``None`` when no
    local config says so (``save_pretrained`` omits a value equal to the config class's default)."""
    config_path = find_local_config(model_name)
    if config_path is None:
        return None, "no local config.json"
    config, error = _read_config(config_path)
    if config is None:
        return None, error
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("tie_word_embeddings"), bool):
            return section["tie_word_embeddings"], f"tie_word_embeddings in {config_path}"
    return None, f"{config_path} does not set tie_word_embeddings"
