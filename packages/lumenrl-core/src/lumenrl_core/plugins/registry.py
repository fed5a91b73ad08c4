"""The plugin registry: lazy, cached discovery of ``lumenrl.<kind>`` entry points.

- Discovery reads installed metadata (``importlib.metadata``) one kind at a time, on first use,
  and never imports plugin code.
- An entry point names a :class:`~lumenrl_core.plugins.spec.PluginSpec` (LumenRL's own plugins) or
  a plugin class (third-party plugins, :meth:`PluginRegistry.register`). For a spec,
  :meth:`PluginRegistry.info` answers from the spec (capabilities, probe) and only
  :meth:`PluginRegistry.load` imports the class, so listing and planning need no torch.
- Two distributions registering the same name in one kind is an error naming both.
- Before a plugin module is imported, its distribution's declared requirements on sibling
  LumenRL packages (``lumenrl-core``, ``lumenrl-quant``, ...) are checked against the installed
  versions (:mod:`lumenrl_core.plugins.compat`).
- A module that fails to import makes its plugin *unavailable* with the error as the reason
  (for a spec: once :meth:`PluginRegistry.load` tried it); it never breaks discovery of the others.
- Tests build isolated registries: ``PluginRegistry(discover=False)`` plus :meth:`register`.
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lumenrl_core.plugins.compat import sibling_requirement_problems
from lumenrl_core.plugins.kinds import KINDS, check_kind, group_of, install_hint
from lumenrl_core.plugins.spec import PluginSpec, as_spec

__all__ = [
    "PluginError",
    "UnknownPluginError",
    "DuplicatePluginError",
    "PluginLoadError",
    "PluginInfo",
    "PluginRegistry",
    "get_registry",
    "set_registry",
]


class PluginError(RuntimeError):
    """Base class of registry errors."""


class UnknownPluginError(PluginError, LookupError):
    """No plugin of that name in that kind."""


class DuplicatePluginError(PluginError):
    """Two distributions register the same name in one kind."""


class PluginLoadError(PluginError, ImportError):
    """The plugin exists but cannot be loaded here (incompatible version, import failure)."""


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What ``lumenrl plugins`` shows for one plugin."""

    kind: str
    name: str
    distribution: str
    version: str
    capabilities: frozenset[str] = frozenset()
    available: bool = False
    reason: str | None = None  # why not available; None when available
    target: str = ""  # "module:attr" of the plugin class (of the entry point if it cannot be read)
    requires: frozenset[str] = frozenset()  # run features the plugin needs the config to provide


@dataclass(slots=True)
class _Entry:
    kind: str
    name: str
    distribution: str
    version: str
    target: str
    loader: Callable[[], Any]
    requires: tuple[str, ...] = ()
    spec: PluginSpec | None = None  # what the entry point declares (a class entry: read from the class)
    plugin: Any = None  # the plugin class, once imported
    load_error: str | None = None  # the entry point (or its version check) failed
    import_error: str | None = None  # the spec's target failed to import
    loaded: bool = False
    probe_done: bool = False
    probe_reason: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str, tuple[str, ...]]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?", ()
    return dist.metadata["Name"], dist.version, tuple(dist.requires or ())


def _run_probe(probe: Callable[[], str | None] | None) -> str | None:
    if probe is None:
        return None
    try:
        reason = probe()
    except Exception as exc:  # noqa: BLE001 - a crashing probe means unusable, not a crash
        return f"probe() raised {type(exc).__name__}: {exc}"
    return str(reason) if reason else None


class PluginRegistry:
    """Plugins by kind and name. ``discover=False`` gives an empty registry for tests."""

    def __init__(self, *, discover: bool = True, check_versions: bool = True) -> None:
        self._discover = discover
        self._check_versions = check_versions
        self._entries: dict[str, dict[str, _Entry]] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- discovery
    def _kind(self, kind: str) -> dict[str, _Entry]:
        check_kind(kind)
        with self._lock:
            if kind not in self._entries:
                self._entries[kind] = {}
                try:
                    for ep in metadata.entry_points(group=group_of(kind)) if self._discover else ():
                        self._add(self._entry_from_ep(kind, ep))
                except BaseException:
                    del self._entries[kind]  # a duplicate keeps raising on every use, not just the first
                    raise
            return self._entries[kind]

    @staticmethod
    def _entry_from_ep(kind: str, ep: metadata.EntryPoint) -> _Entry:
        dist, version, requires = _dist_of(ep)
        return _Entry(kind=kind, name=ep.name, distribution=dist, version=version,
                      target=ep.value, loader=ep.load, requires=requires)

    def _add(self, entry: _Entry) -> None:
        existing = self._entries[entry.kind].get(entry.name)
        if existing is not None:
            if existing.distribution == entry.distribution and existing.target == entry.target:
                return  # the same distribution seen twice on sys.path
            raise DuplicatePluginError(
                f"{entry.kind} plugin {entry.name!r} is registered twice: by "
                f"{existing.distribution} {existing.version} ({existing.target}) and by "
                f"{entry.distribution} {entry.version} ({entry.target}); uninstall one of them"
            )
        self._entries[entry.kind][entry.name] = entry

    def register(
        self,
        kind: str,
        name: str,
        obj: Any,
        *,
        distribution: str = "test",
        version: str = "0.0.0",
        requires: Iterable[str] = (),
    ) -> None:
        """Register the plugin class (or :class:`PluginSpec`) ``obj`` under ``kind``/``name`` (tests,
        programmatic use).

        ``requires`` are ``Requires-Dist`` lines checked like an installed distribution's;
        a name already taken in ``kind`` raises :class:`DuplicatePluginError`."""
        spec = as_spec(obj)
        target = spec.target if spec else f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"
        self.register_loader(kind, name, lambda: obj, target=target, distribution=distribution,
                             version=version, requires=requires)

    def register_loader(
        self,
        kind: str,
        name: str,
        loader: Callable[[], Any],
        *,
        target: str = "",
        distribution: str = "test",
        version: str = "0.0.0",
        requires: Iterable[str] = (),
    ) -> None:
        """Register a plugin whose object is produced by ``loader()`` on first use (may raise)."""
        self._kind(kind)
        with self._lock:
            self._add(_Entry(kind=kind, name=name, distribution=distribution, version=version,
                             target=target, loader=loader, requires=tuple(requires)))

    # ---------------------------------------------------------------- queries
    def kinds(self) -> tuple[str, ...]:
        return KINDS

    def names(self, kind: str) -> list[str]:
        """Sorted plugin names of ``kind`` (no plugin code is imported)."""
        return sorted(self._kind(kind))

    def __contains__(self, key: tuple[str, str]) -> bool:
        kind, name = key
        return name in self._kind(kind)

    def distribution(self, kind: str, name: str) -> tuple[str, str]:
        """``(distribution, version)`` that provides the plugin, without importing it."""
        entry = self._entry(kind, name)
        return entry.distribution, entry.version

    def _entry(self, kind: str, name: str) -> _Entry:
        entries = self._kind(kind)
        if name not in entries:
            raise UnknownPluginError(self.unknown_message(kind, name))
        return entries[name]

    def unknown_message(self, kind: str, name: str) -> str:
        """Why ``name`` is not a plugin of ``kind``: available names, closest match, what to install."""
        available = self.names(kind)
        parts = [f"no {kind} plugin named {name!r}; available: {', '.join(available) or '(none installed)'}"]
        close = difflib.get_close_matches(name, available, n=1)
        if close:
            parts.append(f"did you mean {close[0]!r}?")
        provider = install_hint(kind, name)
        if provider:
            parts.append(f"{name!r} is provided by {provider}: pip install '{provider}'")
        return "; ".join(parts)

    # ---------------------------------------------------------------- loading
    def _resolve(self, entry: _Entry, check_versions: bool) -> None:
        """Check the distribution's sibling requirements, then load the entry point (a spec or a class)."""
        with entry.lock:
            if entry.loaded:
                return
            if check_versions:
                problems = sibling_requirement_problems(entry.distribution, entry.version, entry.requires)
                if problems:
                    entry.load_error = f"incompatible version: {'; '.join(problems)}"
                    return  # not marked loaded: a later call with check_versions=False may import
            try:
                obj = entry.loader()
            except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, anything
                where = f" {entry.target}" if entry.target else ""
                entry.load_error = f"cannot import{where}: {type(exc).__name__}: {exc}"
            else:
                spec = as_spec(obj)
                entry.spec, entry.plugin = (spec, None) if spec else (PluginSpec.of_class(obj, entry.target), obj)
                entry.load_error = None
            entry.loaded = True

    def _import(self, entry: _Entry) -> None:
        """Import a spec's target class (once; a failure is remembered as the reason)."""
        with entry.lock:
            if entry.plugin is not None or entry.import_error is not None:
                return
            try:
                entry.plugin = entry.spec.load()
            except Exception as exc:  # noqa: BLE001 - the plugin's module may raise anything
                entry.import_error = f"cannot import {entry.spec.target}: {type(exc).__name__}: {exc}"

    @staticmethod
    def _failure(kind: str, name: str, entry: _Entry, error: str | None) -> PluginLoadError:
        return PluginLoadError(f"{kind} plugin {name!r} ({entry.distribution} {entry.version}): {error}")

    def spec(self, kind: str, name: str, *, check_versions: bool | None = None) -> PluginSpec:
        """The plugin's :class:`PluginSpec` without importing its class (an entry point that names
        a class gives a spec read from that class); raises like :meth:`load` when the entry point
        cannot be loaded or its distribution is incompatible."""
        entry = self._entry(kind, name)
        self._resolve(entry, self._check_versions if check_versions is None else check_versions)
        if entry.load_error or not entry.loaded:
            raise self._failure(kind, name, entry, entry.load_error)
        return entry.spec

    def load(self, kind: str, name: str, *, check_versions: bool | None = None) -> Any:
        """Import and return the plugin class; raises :class:`UnknownPluginError` or
        :class:`PluginLoadError` (incompatible distribution version, import failure)."""
        self.spec(kind, name, check_versions=check_versions)
        entry = self._entry(kind, name)
        self._import(entry)
        if entry.import_error:
            raise self._failure(kind, name, entry, entry.import_error)
        return entry.plugin

    def info(self, kind: str, name: str, *, check_versions: bool | None = None) -> PluginInfo:
        """Capabilities and availability of one plugin, from its spec (the class is not imported);
        never raises for a known name."""
        entry = self._entry(kind, name)
        self._resolve(entry, self._check_versions if check_versions is None else check_versions)
        target = entry.spec.target if entry.spec else entry.target
        base = dict(kind=kind, name=name, distribution=entry.distribution, version=entry.version, target=target)
        error = entry.load_error or entry.import_error
        if error or not entry.loaded:
            return PluginInfo(**base, available=False, reason=error)
        with entry.lock:
            if not entry.probe_done:
                entry.probe_reason = _run_probe(entry.spec.probe)
                entry.probe_done = True
        return PluginInfo(**base, capabilities=entry.spec.capabilities, requires=entry.spec.requires,
                          available=entry.probe_reason is None, reason=entry.probe_reason)

    def infos(self, kind: str | None = None) -> list[PluginInfo]:
        """:meth:`info` for every plugin of ``kind`` (or of all kinds), sorted by kind then name."""
        kinds = [check_kind(kind)] if kind else list(KINDS)
        return [self.info(k, n) for k in kinds for n in self.names(k)]


_default: PluginRegistry | None = None
_default_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry over installed entry points (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginRegistry()
        return _default


def set_registry(registry: PluginRegistry | None) -> PluginRegistry | None:
    """Replace the process-wide registry (``None``: rediscover on next use); returns the old one."""
    global _default
    with _default_lock:
        old, _default = _default, registry
        return old
