"""Names of the built-in ``lumenrl:`` demo models (torch-free, so config checks can validate them).

``lumenrl-backends`` builds them (``lumenrl_backends.models.builtin``): ``tiny-qwen3-arith`` (the
demo policy, warm-started on arithmetic) and one random tiny model per supported family.
"""

from __future__ import annotations

__all__ = ["BUILTIN_PREFIX", "BUILTIN_FAMILIES", "BUILTIN_MODELS", "is_builtin_name"]

BUILTIN_PREFIX = "lumenrl:"
BUILTIN_FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")
BUILTIN_MODELS: tuple[str, ...] = ("tiny-qwen3-arith", *(f"tiny-{family}" for family in BUILTIN_FAMILIES))


def is_builtin_name(name: str) -> bool:
    """``name`` is ``lumenrl:`` + one of :data:`BUILTIN_MODELS`."""
    return name.startswith(BUILTIN_PREFIX) and name[len(BUILTIN_PREFIX):] in BUILTIN_MODELS
