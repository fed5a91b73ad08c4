"""Model names: Hugging Face ids, local paths and built-in ``lumenrl:`` demo models.

A built-in name (``lumenrl:tiny-qwen3-arith``, ``lumenrl:tiny-<family>``) is materialised once
as an ordinary checkpoint: config from ``AutoConfig``, seeded random weights, the local char
tokenizer, all written with ``save_pretrained`` under ``$LUMENRL_CACHE/<name>/<key>`` (default
``~/.cache/lumenrl/models/<name>/<key>``). ``key`` hashes the builder's settings, the source of
the modules that build it (this one, ``tiny``, ``tokenizer``, ``cache``) and the torch /
transformers versions, so a code change builds a new model instead of reusing an old one; an
entry that fails its checks (see :mod:`lumenrl_backends.models.cache`) is rebuilt. The directory
is built under a temporary name and renamed into place, so a crashed or concurrent build never
leaves a half-written model behind. After that it loads exactly like a user's checkpoint,
always with ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from lumenrl_backends.models import cache, tiny
from lumenrl_backends.models import tokenizer as char_tokenizer
from lumenrl_backends.models.tiny import FAMILIES, build_tiny_model

__all__ = [
    "BUILTIN_PREFIX",
    "builtin_key",
    "builtin_names",
    "is_builtin",
    "model_cache_dir",
    "resolve_model_path",
    "resolve_dtype",
    "load_model_and_tokenizer",
]

BUILTIN_PREFIX = "lumenrl:"

# The demo policy: Qwen3 architecture, ~0.8M parameters, char tokenizer.
_ARITH_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
    "initializer_range": 0.02,
}


def builtin_key(short_name: str) -> str:
    """Cache key of a built-in: its name and settings, the builders' source, torch/transformers versions."""
    material = {"name": short_name, "arith": _ARITH_OVERRIDES, "seed": 0}
    return cache.artifact_key(material, [sys.modules[__name__], tiny, char_tokenizer, cache])


def _builders() -> dict[str, Callable[[Path], Path]]:
    builders: dict[str, Callable[[Path], Path]] = {
        "tiny-qwen3-arith": lambda path: build_tiny_model("qwen3", path, seed=0, **_ARITH_OVERRIDES),
    }
    for family in FAMILIES:
        builders[f"tiny-{family}"] = lambda path, family=family: build_tiny_model(family, path, seed=0)
    return builders


def builtin_names() -> list[str]:
    """All built-in model names, with the ``lumenrl:`` prefix."""
    return [BUILTIN_PREFIX + name for name in _builders()]


def is_builtin(name: str) -> bool:
    return str(name).startswith(BUILTIN_PREFIX)


def model_cache_dir() -> Path:
    """``$LUMENRL_CACHE`` or ``~/.cache/lumenrl/models``."""
    root = os.environ.get("LUMENRL_CACHE") or os.path.join("~", ".cache", "lumenrl", "models")
    return Path(root).expanduser()


@contextlib.contextmanager
def _quiet_progress(quiet: bool = True) -> Iterator[None]:
    """Hide transformers' per-shard progress bars (noise for local tiny checkpoints)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


def _materialise(short_name: str) -> Path:
    builders = _builders()
    if short_name not in builders:
        raise ValueError(
            f"model_name={BUILTIN_PREFIX + short_name!r} is not a built-in model; "
            f"built-ins are {', '.join(builtin_names())}"
        )
    key = builtin_key(short_name)

    def build(staging: Path) -> None:
        with _quiet_progress():
            builders[short_name](staging)

    return cache.build_entry(model_cache_dir() / short_name / key, key, build, {"name": short_name})


def resolve_model_path(name: str) -> str:
    """A local directory for a built-in ``lumenrl:`` name; any other name is returned unchanged."""
    if not is_builtin(name):
        return name
    return str(_materialise(name[len(BUILTIN_PREFIX) :]))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; names -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model_and_tokenizer(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tokenizer_name: str = "",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer; built-ins never touch the network.

    The model is returned in eval mode on ``device``; the tokenizer pads on the left.
    """
    path = resolve_model_path(name_or_path)
    tok_path = resolve_model_path(tokenizer_name) if tokenizer_name else path
    local_only = is_builtin(name_or_path) or Path(path).is_dir()
    with _quiet_progress(local_only):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype, device),
            local_files_only=local_only,
            trust_remote_code=trust_remote_code,
        )
    tokenizer = AutoTokenizer.from_pretrained(
        tok_path,
        local_files_only=is_builtin(tokenizer_name or name_or_path) or Path(tok_path).is_dir(),
        trust_remote_code=trust_remote_code,
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer
