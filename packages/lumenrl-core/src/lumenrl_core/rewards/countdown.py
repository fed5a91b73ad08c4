"""The ``countdown`` reward: reach a target with the given numbers and + - * / (TinyZero task).

The expression is taken from the last ``<answer>...</answer>`` block, else the last
``\\boxed{...}``, else the last non-empty line; anything after a ``=`` is dropped (``"(3+5)*2 =
16"``). It must contain only integers, ``+ - * /``, parentheses and spaces, and is evaluated
exactly with rationals by walking its ``ast`` (never ``eval``): no names, calls, unary minus,
powers or floats; division by zero is invalid. The integers used must be a sub-multiset of the
given numbers (each used at most once), and all of them when ``use_all_numbers``.

Scores: ``correct_score`` when valid and equal to the target, ``format_score`` when valid but
wrong (or when it uses numbers it was not given), 0 when no well-formed expression is found.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from lumenrl_core import plugin_manifest as manifest
from lumenrl_core.rewards.answers import extract_boxed
from lumenrl_core.rewards.math_reward import _check_lengths, _field

__all__ = ["CountdownReward", "countdown_score", "extract_expression", "evaluate_expression"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"^[\d+\-*/()\s]+$")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_MAX_LEN = 200


def extract_expression(text: str) -> str | None:
    """The candidate expression in a response, or None."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        candidate = tagged[-1]
    else:
        candidate = extract_boxed(text)
        if candidate is None:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            candidate = lines[-1] if lines else ""
    candidate = candidate.split("=", 1)[0].strip()
    return candidate or None


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the integer literals used, or None if not a well-formed expression."""
    if len(expression) > _MAX_LEN or not _ALLOWED.match(expression):
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []
    try:
        value = _eval_node(tree.body, used)
    except (ValueError, ZeroDivisionError):
        return None
    return value, used


def _eval_node(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_node(node.left, used), _eval_node(node.right, used)
        op = _OPS[type(node.op)]
        if op == "+":
            return left + right
        if op == "-":
            return left - right
        return left * right if op == "*" else left / right
    raise ValueError(f"disallowed syntax: {type(node).__name__}")


def countdown_score(
    response: str,
    numbers: Sequence[int],
    target: int | float | str,
    *,
    use_all_numbers: bool = True,
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Score one response (see the module docstring)."""
    expression = extract_expression(response)
    result = evaluate_expression(expression) if expression else None
    if result is None:
        return 0.0
    value, used = result
    given, used_counts = Counter(int(n) for n in numbers), Counter(used)
    numbers_ok = used_counts == given if use_all_numbers else not (used_counts - given)
    return correct_score if numbers_ok and value == Fraction(str(target)) else format_score


class CountdownReward:
    """Countdown reward plugin; ``extra[i]`` carries ``numbers`` and ``target`` (``ground_truth``
    may hold ``{"numbers": ..., "target": ...}`` instead); optional per-row ``use_all_numbers``."""

    capabilities = manifest.COUNTDOWN.capabilities

    def __init__(
        self, *, format_score: float = 0.0, correct_score: float = 1.0, use_all_numbers: bool = True
    ) -> None:
        self.format_score = format_score
        self.correct_score = correct_score
        self.use_all_numbers = use_all_numbers

    @classmethod
    def probe(cls) -> str | None:
        return manifest.COUNTDOWN.unavailable_reason()

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], extra: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        _check_lengths(prompts, responses, extra)
        return [
            self._score_one(resp, row, i) for i, (resp, row) in enumerate(zip(responses, extra, strict=True))
        ]

    def _score_one(self, response: str, row: Mapping[str, Any], index: int) -> float:
        source = row if "numbers" in row else _field(row, "ground_truth", index)
        if not isinstance(source, Mapping):
            raise TypeError(
                f"countdown extra row {index} needs 'numbers' and 'target' (got ground_truth={source!r})"
            )
        return countdown_score(
            response,
            _field(source, "numbers", index),
            _field(source, "target", index),
            use_all_numbers=bool(row.get("use_all_numbers", self.use_all_numbers)),
            format_score=self.format_score,
            correct_score=self.correct_score,
        )
