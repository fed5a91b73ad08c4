"""Lazy package exports (PEP 562): public names imported from their submodules on first use.

A package whose ``__init__`` must stay torch-free (the plugin registry imports its torch-free
``plugin_manifest``, which runs the package's ``__init__`` first) declares its exports and binds::

    __all__, __getattr__, __dir__ = lazy_exports(globals(), {"weight_sync": ("InProcessWeightSync",)})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``;
    ``exports`` maps a submodule to the public names it defines. A name is imported once, then cached
    in the package's namespace; ``__version__`` is listed first when the package defines it."""
    package = namespace["__name__"]
    module_of = {name: f"{package}.{module}" for module, names in exports.items() for name in names}
    public = (["__version__"] if "__version__" in namespace else []) + list(module_of)

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name]), name)
        namespace[name] = value  # later lookups do not come back here
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(public))

    return public, __getattr__, __dir__
