"""Megatron-Core training backend: availability probe only in this release.

``probe()`` checks for the real Megatron-Core API (``megatron.core.parallel_state``,
``megatron.core.models.gpt.GPTModel``, ``megatron.core.optimizer.get_megatron_optimizer``),
so a namesake package or an incompatible version is reported as such. Even where it is
available, building a ``MegatronBackend`` raises: the HF <-> Megatron weight conversion,
TP/PP/EP process groups and the pipelined train step are not implemented yet. Use ``fsdp2``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["MegatronBackend"]

_REQUIRED = (
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.models.gpt", "GPTModel"),
    ("megatron.core.optimizer", "get_megatron_optimizer"),
)
_NOT_IMPLEMENTED = (
    "policy.training_backend='megatron' is not implemented in this release of lumenrl-backends "
    "(Megatron-Core was found, but LumenRL has no HF<->Megatron conversion or pipelined train step yet); "
    "use policy.training_backend='fsdp2'"
)


def _missing_api() -> str | None:
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


class MegatronBackend:
    """Placeholder that reports why Megatron-Core training is unavailable; never trains."""

    capabilities: frozenset[str] = frozenset()  # claims nothing until it can run

    @classmethod
    def probe(cls) -> str | None:
        reason = _missing_api()
        return reason if reason is not None else _NOT_IMPLEMENTED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_missing_api() or _NOT_IMPLEMENTED)

    @classmethod
    def from_config(cls, cfg: Any, *, role: str, model_path: str) -> MegatronBackend:
        return cls(cfg, role=role, model_path=model_path)
