"""``ConfigError``: one line that names the key, the bad value, what is allowed and a close match."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError", "ConfigProblems", "closest"]

_NO_VALUE: Any = object()
_MAX_VALUE_CHARS = 80


class ConfigError(Exception):
    """A bad run configuration, reported on one line.

    ``str(err)`` reads like::

        config key 'policy.modle_name' = 'Qwen/Qwen3-8B': unknown key (did you mean 'policy.model_name'?);
        allowed: model_name, tokenizer_name, ... [override 'policy.modle_name=Qwen/Qwen3-8B']

    (printed on one line). The parts are also attributes: ``key`` (full dotted key or None for
    file-level problems), ``value``, ``problem``, ``allowed``, ``suggestion``, ``source`` (the
    file or override the value came from).
    """

    def __init__(
        self,
        key: str | None,
        value: Any = _NO_VALUE,
        *,
        problem: str,
        allowed: str | None = None,
        suggestion: str | None = None,
        source: str | None = None,
    ) -> None:
        self.key, self.value, self.problem = key, value, problem
        self.allowed, self.suggestion, self.source = allowed, suggestion, source
        super().__init__(self._line())

    @property
    def has_value(self) -> bool:
        return self.value is not _NO_VALUE

    def _line(self) -> str:
        head = f"config key {self.key!r}" if self.key else "config"
        if self.has_value:
            head += f" = {_short_repr(self.value)}" if self.key else f" value {_short_repr(self.value)}"
        line = f"{head}: {self.problem}"
        if self.suggestion:
            line += f" (did you mean {self.suggestion!r}?)"
        if self.allowed:
            line += f"; allowed: {self.allowed}"
        if self.source:
            line += f" [{self.source}]"
        return line.replace("\r", " ").replace("\n", " ")

    def __reduce__(self):  # picklable across processes (Ray workers) despite keyword-only arguments
        return _rebuild, (self.key, self.value, self.problem, self.allowed, self.suggestion, self.source)


def _rebuild(key, value, problem, allowed, suggestion, source) -> ConfigError:
    return ConfigError(key, value, problem=problem, allowed=allowed, suggestion=suggestion, source=source)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def closest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The candidate most similar to ``word`` (difflib ratio >= ``cutoff``), or None."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return matches[0] if matches else None


class ConfigProblems(ConfigError):
    """Several config problems found at once: ``errors`` holds one ConfigError each; ``str()`` has one line each."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.key, first.value, problem=first.problem, allowed=first.allowed,
                         suggestion=first.suggestion, source=first.source)
        self.args = ("\n".join(str(e) for e in self.errors),)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return ConfigProblems, (self.errors,)
