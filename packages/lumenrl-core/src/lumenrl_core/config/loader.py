"""Load a :class:`RunConfig`: schema defaults <- YAML file (with ``defaults:`` bases) <- dotted overrides.

Every layer is deep-merged into plain data first (mappings merge key by key, any other value
replaces), remembering which file or override set each key; then the whole tree is built into
dataclasses once, so every problem (unknown key, wrong type, bad choice, out-of-range value) is
reported as a one-line :class:`ConfigError` that names the key and where it was set, before
anything heavy is imported or loaded.

A YAML file may start with ``defaults: [base.yaml, ...]`` (paths relative to that file): the bases
are loaded first, in order, and the file's own keys override them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lumenrl_core.config.errors import ConfigError, ConfigProblems
from lumenrl_core.config.legacy import is_legacy_key, translate
from lumenrl_core.config.refusals import refusal_errors
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.config.semantic import semantic_errors
from lumenrl_core.config.typed import Builder, fields_of, join_key, section_type, suggest_key, unwrap_optional

__all__ = [
    "load_config",
    "config_from_dict",
    "validate_config",
    "config_to_dict",
    "dump_config",
    "parse_override",
]

DEFAULTS_KEY = "defaults"

Layer = tuple[dict[str, Any], str]  # (data, where it came from)


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Iterable[str] | None = (), *, machine: bool = True
) -> RunConfig:
    """The run config from a YAML file (None: schema defaults) plus ``key=value`` overrides, validated.

    Later overrides win over earlier ones; overrides win over the file, the file over its
    ``defaults:`` bases, and those over the schema defaults. Original-LumenRL keys are read as
    their current keys (:mod:`.legacy`); keys of features not built yet are refused when set
    (:mod:`.refusals`); whole-config checks (:mod:`.semantic`) run last and every problem they
    find is reported at once (:class:`ConfigProblems`, one line each). ``machine=False`` skips the
    checks that depend on this machine (model paths, devices), e.g. to inspect a GPU preset here.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    layers = _read_layers(Path(path), ()) if path is not None else []
    bad: list[ConfigError] = []  # every bad override is reported, with the file's own problems
    for text in overrides or ():
        try:
            layers.append(_override_layer(text))
        except ConfigError as exc:
            bad.append(exc)
    return _build(layers, machine=machine, bad_overrides=bad)


def config_from_dict(data: Mapping[str, Any], source: str = "dict", *, machine: bool = True) -> RunConfig:
    """A validated RunConfig from nested plain data (same rules as a YAML file, no ``defaults:``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(None, data, problem="the config must be a mapping", source=source)
    return _build([(dict(data), source)], machine=machine)


def validate_config(cfg: RunConfig, *, machine: bool = True) -> RunConfig:
    """Re-check a programmatically built RunConfig; returns a validated (coerced) copy."""
    return config_from_dict(config_to_dict(cfg), source="RunConfig object", machine=machine)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain data (dicts, lists, scalars) of a config dataclass."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    """The config as YAML text that ``load_config`` reads back to an equal config.

    Non-ASCII text is written as is when PyYAML reads it back unchanged, escaped otherwise
    (PyYAML folds some characters, such as U+0085, inside plain-quoted scalars).
    """
    data = config_to_dict(cfg)
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    if yaml.safe_load(text) != data:
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return text


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=VALUE"`` -> ``("a.b", value)``.

    VALUE is parsed as YAML (``[1, 2]``, ``{k: v}``, ``true``, ``1e-6``), except for str fields,
    which take the text as typed (``0123``, ``run #3`` stay strings) unless it is quoted
    (``'a b'``); ``null`` sets an optional field to None.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    source = f"override {text!r}"
    if not sep or not key:
        raise ConfigError(
            None, problem=f"override {text!r} must look like KEY=VALUE", allowed="e.g. policy.optim.lr=1e-6"
        )
    if is_legacy_key(key):  # an original-LumenRL key: typed by its handler in .legacy
        return key, _yaml_value(key, raw, source)
    base, optional = unwrap_optional(_type_at(key, text, source))
    stripped = raw.strip()
    if optional and stripped in ("null", "~"):
        return key, None
    if base is str and not _is_quoted(stripped):
        _check_free_text(key, stripped, source)
        return key, stripped
    return key, _yaml_value(key, raw, source)


def _yaml_value(key: str, raw: str, source: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(
            key, raw, problem=f"value is not valid YAML ({_yaml_problem(exc)})", source=source
        ) from None


def _check_free_text(key: str, text: str, source: str) -> None:
    """A str field typed as ``null``, a YAML list or a ``{k: v}`` mapping is a mistake, not text.

    (``{prompt}`` stays text: YAML reads it as a key without a value, which no one means as a mapping.)
    """
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if parsed is None and text in ("null", "~", "Null", "NULL") or isinstance(parsed, list) or (
        isinstance(parsed, dict) and any(v is not None for v in parsed.values())
    ):
        raise ConfigError(key, parsed, problem=f"wrong type ({type(parsed).__name__})",
                          allowed="str (quote it, e.g. 'null', to mean the text)", source=source)


def _is_quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


# ------------------------------------------------------------------ internals
def _build(layers: list[Layer], *, machine: bool = True, bad_overrides: list[ConfigError] = ()) -> RunConfig:
    default = RunConfig()
    data = config_to_dict(default)
    sources: dict[str, str] = {}
    for layer, source in layers:
        _merge(data, translate(layer, data, source), "", source, sources)
    builder = Builder(RunConfig, sources)
    try:
        cfg = builder.build(RunConfig, data)
    except ConfigError as exc:  # type/range/unknown-key problems: all of them, with the bad overrides
        found = exc.errors if isinstance(exc, ConfigProblems) else [exc]
        _raise_all([*bad_overrides, *found])
    _raise_all(list(bad_overrides))
    order = {source: i for i, (_, source) in enumerate(layers)}  # later layers rank higher; unset keys -1

    def rank(key: str) -> int:
        return order.get(sources.get(key, ""), -1)

    _raise_all(refusal_errors(cfg, default, builder.source)
               + semantic_errors(cfg, builder.source, machine=machine, rank=rank))
    return cfg


def _raise_all(errors: list[ConfigError]) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems(errors)


def _merge(
    base: dict[Any, Any], layer: Mapping[Any, Any], prefix: str, source: str, sources: dict[str, str]
) -> None:
    for name, value in layer.items():
        key = join_key(prefix, str(name))
        if isinstance(base.get(name), dict) and (value is None or isinstance(value, Mapping)):
            sources.setdefault(key, source)  # an empty section ("policy:") changes nothing
            _merge(base[name], value or {}, key, source, sources)
            continue
        for stale in [k for k in sources if k.startswith(key + ".")]:
            del sources[stale]
        base[name] = copy.deepcopy(value)
        sources[key] = source


def _override_layer(text: str) -> Layer:
    key, value = parse_override(text)
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested, f"override {text!r}"


def _type_at(key: str, text: str, source: str) -> Any:
    """The declared type of dotted ``key``; unknown keys raise with the closest valid key."""
    cls: type | None = RunConfig
    tp: Any = RunConfig
    for i, part in enumerate(key.split(".")):
        if cls is None:
            parent = ".".join(key.split(".")[:i])
            raise ConfigError(
                key, text.partition("=")[2], problem=f"{parent!r} is a value, not a section", source=source
            )
        specs = fields_of(cls)
        if part not in specs:
            raise ConfigError(
                key,
                text.partition("=")[2],
                problem="unknown key",
                suggestion=suggest_key(RunConfig, key),
                allowed=f"keys of {'the top level' if i == 0 else repr('.'.join(key.split('.')[:i]))}: "
                + ", ".join(specs),
                source=source,
            )
        tp = specs[part].type
        cls = section_type(tp)
    return tp


def _read_layers(path: Path, chain: tuple[Path, ...]) -> list[Layer]:
    """The layers of one YAML file: its ``defaults`` bases (recursively, in order), then itself."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(
            DEFAULTS_KEY, str(path), problem=f"circular defaults ({cycle})", source=f"file {chain[-1]}"
        )
    data = _read_yaml(path)
    bases = data.pop(DEFAULTS_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(
            DEFAULTS_KEY,
            bases,
            problem="must be a list of YAML paths",
            allowed="[base.yaml, ...]",
            source=f"file {path}",
        )
    layers: list[Layer] = []
    for base in bases:
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError(
                DEFAULTS_KEY,
                base,
                problem=f"file not found: {base_path}",
                allowed="paths relative to this file",
                source=f"file {path}",
            )
        layers += _read_layers(base_path, (*chain, resolved))
    layers.append((data, f"file {path}"))
    return layers


def _read_yaml(path: Path) -> dict[Any, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            None, problem=f"cannot read config file {str(path)!r}: {exc.strerror or exc}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            None, problem=f"invalid YAML ({_yaml_problem(exc)})", source=f"file {path}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            None,
            data,
            problem="the top level must be a mapping of keys",
            allowed="seed: 1, policy: {...}, ...",
            source=f"file {path}",
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
