"""Is a usable Megatron-Core installed? ``missing_api()`` returns why not, or None.

Checks the real Megatron-Core API (``megatron.core.parallel_state``, ``GPTModel``, the local
layer spec), so a namesake ``megatron`` package or an incompatible version is reported as such.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["missing_api"]

_REQUIRED = (
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.models.gpt", "GPTModel"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
)


def missing_api() -> str | None:
    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed (pip install 'lumenrl-backends[megatron]')"
    for module, attr in _REQUIRED:
        try:
            found = hasattr(importlib.import_module(module), attr)
        except Exception as exc:  # a namesake 'megatron' package, or a broken install
            return f"megatron.core is not usable: importing {module} failed ({type(exc).__name__}: {exc})"
        if not found:
            return f"megatron.core has no {module}.{attr}: not a supported Megatron-Core version"
    return None
