"""What an entry point names: a :class:`PluginSpec`, importable without torch.

A spec says where the plugin class lives (``target``), what it can do (``capabilities``), what it
needs of the run (``requires``: run features such as ``critic``, see
:func:`lumenrl_core.assembly.run_features`) and whether it can run here (``probe``), so the registry
can list, check and plan plugins without importing their code. The class reads its ``capabilities`` from its spec and delegates its
``probe()`` to it, so the spec is the one place they are written:

    # lumenrl_x/plugin_manifest.py -- no torch, no plugin code
    FAST = PluginSpec("lumenrl_x.engines:FastEngine", {"logprobs"}, probe=lambda: module_probe("fastlib"))

    # lumenrl_x/engines.py
    class FastEngine:
        capabilities = plugin_manifest.FAST.capabilities

        @classmethod
        def probe(cls):
            return plugin_manifest.FAST.unavailable_reason()

    # pyproject.toml
    [project.entry-points."lumenrl.rollout_engines"]
    fast = "lumenrl_x.plugin_manifest:FAST"

A distribution that does not depend on lumenrl-core (lumenrl-quant) declares an object of the same
shape: :func:`as_spec` reads any non-class object with a string ``target`` and ``capabilities``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PluginSpec", "as_spec"]


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """A plugin as declared by its distribution, before its code is imported.

    target: ``"module:attr"`` of the plugin class (``attr`` may be dotted).
    capabilities: what the plugin can do (``fp8_weights``, ``route_recording``, ...): the config
        demands them of the plugin (assembly's ``required_capabilities``).
    probe: ``None`` when it can run here, else the reason; must not import torch unless the
        answer needs it (it runs only for plugins a config names, or ``lumenrl plugins``).
    requires: run features the plugin needs the config to provide (``critic``: value estimates in
        the batch; ``task:<dataset.name>``: rows of that task); assembly refuses a config that
        lacks one, naming the plugin and the config key that would provide it.
    """

    target: str
    capabilities: frozenset[str] = field(default_factory=frozenset)
    probe: Callable[[], str | None] | None = None
    requires: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        module, sep, attr = self.target.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"target={self.target!r}: expected 'package.module:Class'")
        for name in ("capabilities", "requires"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name}={value!r}: expected a collection of names, not one string")
            object.__setattr__(self, name, frozenset(value))

    def unavailable_reason(self) -> str | None:
        """Run :attr:`probe`: ``None`` when the plugin can run here, else why not."""
        return self.probe() if self.probe is not None else None

    def load(self) -> Any:
        """Import :attr:`target` and return the plugin class (raises what the import raises)."""
        module, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    @classmethod
    def of_class(cls, obj: Any, target: str) -> PluginSpec:
        """The spec of a plugin registered as a class: its ``capabilities``, ``probe()`` and ``requires`` read from it."""
        caps: Iterable[str] = getattr(obj, "capabilities", None) or ()
        requires: Iterable[str] = getattr(obj, "requires", None) or ()
        return cls(target if ":" in target else _target_of(obj), frozenset(caps), getattr(obj, "probe", None),
                   frozenset(requires))


def _target_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def as_spec(obj: Any) -> PluginSpec | None:
    """``obj`` as a :class:`PluginSpec` if it is one (or has a spec's shape), else ``None`` (a plugin class)."""
    if isinstance(obj, PluginSpec):
        return obj
    if isinstance(obj, type) or not isinstance(getattr(obj, "target", None), str) or not hasattr(obj, "capabilities"):
        return None
    return PluginSpec(obj.target, frozenset(obj.capabilities), getattr(obj, "probe", None),
                      frozenset(getattr(obj, "requires", None) or ()))
