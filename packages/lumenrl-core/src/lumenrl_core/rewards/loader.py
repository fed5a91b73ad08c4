"""User reward functions: ``reward.function = "module:fn"`` (or ``"path/to/file.py:fn"``).

The function is called as ``fn(prompts, responses, extra) -> list[float]`` with one entry per
row (the ``RewardFn`` protocol). ``load_reward_function`` resolves it and wraps it in
``UserReward``, which checks that it returned one finite number per row.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load_reward_function", "UserReward"]


class UserReward:
    """A user callable behind the ``RewardFn`` protocol, with output validation."""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, fn: Callable[..., Sequence[float]], *, name: str) -> None:
        self.fn = fn
        self.name = name

    @classmethod
    def probe(cls) -> str | None:
        return None

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], extra: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        out = self.fn(list(prompts), list(responses), list(extra))
        try:
            scores = [float(s) for s in out]
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"reward function {self.name} must return a list of numbers, got {out!r:.200}"
            ) from exc
        if len(scores) != len(responses):
            raise ValueError(
                f"reward function {self.name} returned {len(scores)} scores for {len(responses)} responses"
            )
        bad = [s for s in scores if not math.isfinite(s)]
        if bad:
            raise ValueError(f"reward function {self.name} returned non-finite scores: {bad[:5]}")
        return scores


def load_reward_function(spec: str) -> UserReward:
    """Resolve ``"module:fn"`` / ``"file.py:fn"`` to a validated reward callable."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward.function={spec!r} is invalid: expected 'module:function' or 'path/to/file.py:function'"
        )
    module = _import(module_name, spec)
    if not hasattr(module, attr):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(attr, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; callables there: {public[:10]}"
        raise AttributeError(
            f"reward.function={spec!r}: module {module_name!r} has no attribute {attr!r}{hint}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"reward.function={spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return UserReward(fn, name=spec)


def _import(module_name: str, spec: str) -> ModuleType:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"reward.function={spec!r}: file {str(path)!r} does not exist")
        loader_spec = importlib.util.spec_from_file_location(f"lumenrl_user_reward_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"reward.function={spec!r}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[loader_spec.name] = module
        loader_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ModuleNotFoundError(
                f"reward.function={spec!r}: module {module_name!r} not found (is it installed or on PYTHONPATH?)",
                name=exc.name,
            ) from exc
        raise
