"""Model utilities: the local char tokenizer, tiny configs of every family, built-in demo models."""

from lumenrl_backends.models.builtin import (
    BUILTIN_PREFIX,
    builtin_key,
    builtin_names,
    is_builtin,
    load_model_and_tokenizer,
    model_cache_dir,
    resolve_dtype,
    resolve_model_path,
)
from lumenrl_backends.models.tiny import FAMILIES, build_tiny_model, tiny_config
from lumenrl_backends.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

__all__ = [
    "BUILTIN_PREFIX",
    "CHAT_TEMPLATE",
    "FAMILIES",
    "build_char_tokenizer",
    "build_tiny_model",
    "builtin_key",
    "builtin_names",
    "is_builtin",
    "load_model_and_tokenizer",
    "model_cache_dir",
    "resolve_dtype",
    "resolve_model_path",
    "tiny_config",
]
