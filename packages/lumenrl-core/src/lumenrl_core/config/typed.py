"""Build config dataclasses from plain data (YAML, overrides) with type coercion and validation.

Coercion is deliberately narrow: values are converted only where the intent is unambiguous
(``1`` -> ``1.0`` for a float, ``"1e-6"`` -> ``1e-06`` because YAML 1.1 reads that as a string,
``2.0`` -> ``2`` for an int, ``123`` -> ``"123"`` for a str, ``"true"`` -> ``True``). Anything
else (a bool for an int, a scalar for a list, a string for a number that does not parse) raises
:class:`ConfigError` naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from lumenrl_core.config.errors import ConfigError, ConfigProblems, closest
from lumenrl_core.config.rules import check_range, cross_check, field_range, join_key

__all__ = [
    "FieldSpec",
    "fields_of",
    "all_keys",
    "type_name",
    "unwrap_optional",
    "join_key",
    "suggest_key",
    "Builder",
]

_NONE = type(None)


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    type: Any
    metadata: Mapping[str, Any]


@functools.cache
def fields_of(cls: type) -> dict[str, FieldSpec]:
    """The init fields of dataclass ``cls`` with their resolved (non-string) types."""
    hints = typing.get_type_hints(cls)
    return {f.name: FieldSpec(f.name, hints[f.name], f.metadata) for f in dataclasses.fields(cls) if f.init}


@functools.cache
def all_keys(cls: type) -> tuple[str, ...]:
    """Every dotted key under dataclass ``cls`` (sections and leaves), in declaration order."""
    keys: list[str] = []
    for name, spec in fields_of(cls).items():
        keys.append(name)
        section = section_type(spec.type)
        if section is not None:
            keys.extend(f"{name}.{sub}" for sub in all_keys(section))
    return tuple(keys)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if _is_union(tp):
        args = get_args(tp)
        rest = [a for a in args if a is not _NONE]
        if len(rest) == 1 and len(args) == 2:
            return rest[0], True
    return tp, False


def section_type(tp: Any) -> type | None:
    """The dataclass behind a section field (``Cls`` or ``Cls | None``), else None."""
    base, _ = unwrap_optional(tp)
    return base if dataclasses.is_dataclass(base) and isinstance(base, type) else None


def type_name(tp: Any) -> str:
    """How an allowed type reads in an error message."""
    if tp is Any:
        return "any value"
    if tp is _NONE:
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a section with keys {', '.join(fields_of(tp))}"
    if _is_union(tp):
        return " or ".join(type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    if isinstance(tp, type) and not get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def suggest_key(root: type, key: str) -> str | None:
    """The valid dotted key closest to an unknown ``key`` (typo in one part, or a leaf in a deeper section)."""
    parts, prefix, cls = key.split("."), [], root
    for i, part in enumerate(parts):
        specs = fields_of(cls)
        if part not in specs:
            # an exact leaf name in a deeper section beats a near name here ("policy.lr" -> policy.optim.lr)
            deeper = [k for k in all_keys(cls) if k.rsplit(".", 1)[-1] == parts[-1]]
            if deeper and i == len(parts) - 1:
                return ".".join([*prefix, deeper[0]])
            local = closest(part, specs)
            if local:
                return ".".join([*prefix, local, *parts[i + 1 :]])
            if deeper:
                return ".".join([*prefix, deeper[0]])
            return closest(key, all_keys(root))
        section = section_type(specs[part].type)
        if section is None:
            return None
        prefix.append(part)
        cls = section
    return None


class _Mismatch(Exception):
    """A value that cannot be coerced to the target scalar type."""


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _Mismatch


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = _to_float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _Mismatch


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise _Mismatch from None
    else:
        raise _Mismatch
    if math.isnan(out):
        raise _Mismatch
    return out


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise _Mismatch


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


class Builder:
    """Turns nested plain data into config dataclasses; ``sources`` maps dotted keys to where they were set."""

    def __init__(self, root: type, sources: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.sources = dict(sources or {})
        self._errors: list[ConfigError] | None = None  # collected while a top-level build runs

    def source(self, key: str) -> str | None:
        """Where ``key`` (or the closest enclosing section) was set; None for defaults."""
        while key:
            if key in self.sources:
                return self.sources[key]
            key = key.rpartition(".")[0]
        return None

    def error(self, key: str, value: Any, problem: str, **extra: Any) -> ConfigError:
        return ConfigError(key or None, value, problem=problem, source=self.source(key), **extra)

    def build(self, cls: type, data: Any, prefix: str = "") -> Any:
        """An instance of dataclass ``cls`` from a mapping, every field coerced and checked.

        Every bad field of the whole tree is reported at once: the top-level call raises one
        :class:`ConfigError`, or :class:`ConfigProblems` (one line each) when there are several."""
        if self._errors is not None:
            return self._build(cls, data, prefix)
        self._errors = []
        try:
            obj = self._build(cls, data, prefix)
        except ConfigError as exc:  # a section that cannot be built at all
            self._errors.append(exc)
        errors, self._errors = self._errors, None
        if errors:
            raise errors[0] if len(errors) == 1 else ConfigProblems(errors)
        return obj

    def _build(self, cls: type, data: Any, prefix: str) -> Any:
        assert self._errors is not None
        if not isinstance(data, Mapping):
            raise self.error(prefix, data, f"wrong type ({type(data).__name__})", allowed=type_name(cls))
        specs = fields_of(cls)
        kwargs, before = {}, len(self._errors)
        for raw_name, value in data.items():
            key = join_key(prefix, str(raw_name))
            spec = specs.get(raw_name) if isinstance(raw_name, str) else None
            try:
                if spec is None:
                    raise self._unknown(key, value, specs, prefix)
                kwargs[spec.name] = self._field(cls, spec, value, key)
            except ConfigError as exc:  # keep going: the field keeps its default, the error is reported
                self._errors.append(exc)
        try:
            obj = cls(**kwargs)
        except TypeError as exc:  # a field without a default that the data does not set
            raise self.error(prefix, data, str(exc)) from None
        if len(self._errors) == before:  # cross-field rules judge only sections whose fields all parsed
            cross_check(obj, prefix, self.source)
        return obj

    def _field(self, cls: type, spec: FieldSpec, value: Any, key: str) -> Any:
        out = self.coerce(spec.type, value, key)
        choices = spec.metadata.get("choices")
        if choices is not None:
            for item in out if isinstance(out, list) else [out]:
                if item not in choices:
                    raise self.error(
                        key,
                        item,
                        "not an allowed value",
                        allowed="one of " + ", ".join(map(str, choices)),
                        suggestion=closest(str(item), [str(c) for c in choices]),
                    )
        check_range(field_range(cls, spec.name, spec.metadata), out, key, self.source(key))
        return out

    def _unknown(self, key: str, value: Any, specs: Mapping[str, FieldSpec], prefix: str) -> ConfigError:
        where = f"keys of {prefix!r}" if prefix else "top-level keys"
        return self.error(
            key,
            value,
            "unknown key",
            suggestion=suggest_key(self.root, key),
            allowed=f"{where}: {', '.join(specs)}",
        )

    def coerce(self, tp: Any, value: Any, key: str) -> Any:
        """``value`` converted to type ``tp`` (see the module docstring), or a ConfigError."""
        if tp is Any:
            return value
        base, optional = unwrap_optional(tp)
        if value is None and optional:
            return None
        if section_type(base) is not None:
            return self._section(base, value, key)
        origin = get_origin(base)
        if origin in (list, tuple):
            return self._sequence(base, value, key)
        if origin is dict:
            return self._mapping(base, value, key)
        if origin is Literal:
            if value in get_args(base):
                return value
            raise self.error(key, value, "not an allowed value", allowed=type_name(tp))
        if _is_union(base):
            return self._union(tp, value, key)
        return self._scalar(tp, base, value, key)

    def _scalar(self, tp: Any, base: Any, value: Any, key: str) -> Any:
        convert = _SCALARS.get(base)
        if convert is not None:
            try:
                return convert(value)
            except _Mismatch:
                pass
        elif isinstance(base, type) and isinstance(value, base):
            return value
        raise self.error(key, value, f"wrong type ({type(value).__name__})", allowed=type_name(tp))

    def _section(self, cls: type, value: Any, key: str) -> Any:
        if value is None:  # an empty YAML section ("policy:" with nothing under it)
            value = {}
        elif isinstance(value, cls):
            value = {f: getattr(value, f) for f in fields_of(cls)}
        return self.build(cls, value, key)

    def _sequence(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, (list, tuple)):
            hint = f"{type_name(tp)}, written [a, b, ...]"
            raise self.error(key, value, f"wrong type ({type(value).__name__})", allowed=hint)
        args = get_args(tp)
        if get_origin(tp) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise self.error(key, value, f"needs exactly {len(args)} values", allowed=type_name(tp))
            return tuple(self.coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item_type = args[0] if args else Any
        items = [self.coerce(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if get_origin(tp) is tuple else items

    def _mapping(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, Mapping):
            raise self.error(key, value, f"wrong type ({type(value).__name__})", allowed=type_name(tp))
        key_type, value_type = get_args(tp) or (Any, Any)
        return {
            self.coerce(key_type, k, key): self.coerce(value_type, v, join_key(key, str(k)))
            for k, v in value.items()
        }

    def _union(self, tp: Any, value: Any, key: str) -> Any:
        for arm in get_args(tp):
            if arm is _NONE:
                if value is None:
                    return None
                continue
            try:
                return self.coerce(arm, value, key)
            except ConfigError:
                continue
        raise self.error(key, value, f"wrong type ({type(value).__name__})", allowed=type_name(tp))
