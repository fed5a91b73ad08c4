"""Verifiable tasks generated in code: multi-digit arithmetic and countdown.

Both produce *records*, plain JSON-able dicts ``{"prompt": str, "ground_truth": ..., "extra":
dict}`` (the shape every dataset source yields, see :mod:`lumenrl_core.data.records`), seeded
and reproducible. Prompts use only digits, ``+ - * / = ( )``, spaces and lower-case letters, so a
character-level demo tokenizer covers them, and answers are short (a bare integer), so a tiny
model can learn the task with responses of at most 8 tokens.

- ``ArithmeticTask``: ``"12+7="`` -> ``"19"``; operands uniform in [0, 10^difficulty - 1];
  subtraction keeps a >= b unless ``allow_negative``; scored by the ``math`` reward.
- ``CountdownTask``: ``"use 3 5 2 to make 16:"`` -> an expression such as ``"(3+5)*2"``; every
  problem is solvable with all numbers (it is generated from a random expression tree with
  non-negative integer intermediates); scored by the ``countdown`` reward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["ArithmeticTask", "CountdownTask"]

ARITHMETIC_OPS = ("+", "-", "*")


@dataclass(kw_only=True, slots=True)
class ArithmeticTask:
    """Multi-digit arithmetic problems.

    num_examples: records to generate. difficulty: maximum digits per operand (>= 1).
    ops: operators drawn uniformly, a subset of ``+ - *``. seed: RNG seed.
    allow_negative: let subtraction go below zero (else operands are ordered a >= b).
    """

    num_examples: int = 2000
    difficulty: int = 2
    ops: tuple[str, ...] = ("+", "-")
    seed: int = 0
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if self.difficulty < 1:
            raise ValueError(f"difficulty={self.difficulty!r} is invalid: digits per operand, allowed >= 1")
        if self.num_examples < 1:
            raise ValueError(f"num_examples={self.num_examples!r} is invalid: allowed >= 1")
        bad = [op for op in self.ops if op not in ARITHMETIC_OPS]
        if bad or not self.ops:
            raise ValueError(f"ops={self.ops!r} is invalid: a non-empty subset of {ARITHMETIC_OPS}")

    @staticmethod
    def format_prompt(a: int, op: str, b: int) -> str:
        """``"12+7="``: operands and operator without spaces, then ``=``."""
        return f"{a}{op}{b}="

    @staticmethod
    def format_answer(value: int) -> str:
        """The answer as the model should emit it: the bare integer, e.g. ``"19"``."""
        return str(value)

    @staticmethod
    def solve(a: int, op: str, b: int) -> int:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        raise ValueError(f"op={op!r} is invalid: allowed {ARITHMETIC_OPS}")

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """One record drawn from ``rng``."""
        high = 10**self.difficulty - 1
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(self.ops)
        if op == "-" and a < b and not self.allow_negative:
            a, b = b, a
        answer = self.format_answer(self.solve(a, op, b))
        return {
            "prompt": self.format_prompt(a, op, b),
            "ground_truth": answer,
            "extra": {"a": a, "op": op, "b": b},
        }

    def records(self, *, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """``num_examples`` seeded records, skipping prompts in ``exclude`` (e.g. a train split)."""
        return _draw(self.sample, self.num_examples, self.seed, exclude)


@dataclass(kw_only=True, slots=True)
class CountdownTask:
    """Countdown problems: reach ``target`` from ``numbers`` with + - * / (each number once).

    num_examples: records to generate. num_numbers: numbers per problem (>= 2).
    max_number: numbers are drawn from [1, max_number]. max_target: targets are kept in
    [1, max_target]. seed: RNG seed. instruct: a natural-language prompt asking for
    ``<answer>...</answer>`` tags (for real LLMs) instead of the compact one.
    """

    num_examples: int = 2000
    num_numbers: int = 3
    max_number: int = 10
    max_target: int = 100
    seed: int = 0
    instruct: bool = False

    def __post_init__(self) -> None:
        if self.num_numbers < 2:
            raise ValueError(f"num_numbers={self.num_numbers!r} is invalid: allowed >= 2")
        if self.max_number < 1 or self.max_target < 1 or self.num_examples < 1:
            raise ValueError(
                f"max_number={self.max_number!r}, max_target={self.max_target!r}, "
                f"num_examples={self.num_examples!r}: all must be >= 1"
            )

    def format_prompt(self, numbers: list[int], target: int) -> str:
        listed = " ".join(str(n) for n in numbers)
        if not self.instruct:
            return f"use {listed} to make {target}:"
        return (
            f"Using the numbers [{', '.join(str(n) for n in numbers)}], create an equation that equals {target}. "
            "You can use + - * / and parentheses, and each number exactly once. "
            "Give the final equation in <answer></answer> tags, for example <answer>(1 + 2) / 3</answer>."
        )

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """One solvable record drawn from ``rng``."""
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            target, solution = _random_expression(numbers, rng)
            if 1 <= target <= self.max_target:
                break
        truth = {"numbers": numbers, "target": target}
        return {
            "prompt": self.format_prompt(numbers, target),
            "ground_truth": truth,
            "extra": {**truth, "solution": solution},
        }

    def records(self, *, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        return _draw(self.sample, self.num_examples, self.seed, exclude)


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """Combine all numbers pairwise at random, keeping integer, non-negative intermediates."""
    pool = [(n, str(n)) for n in numbers]
    while len(pool) > 1:
        (a, ea), (b, eb) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
        if a < b:
            (a, ea), (b, eb) = (b, eb), (a, ea)
        options = [
            (a + b, f"({ea}+{eb})"),
            (a * b, f"{_wrap(ea)}*{_wrap(eb)}"),
            (a - b, f"({ea}-{_wrap(eb)})"),
        ]
        if b and a % b == 0:
            options.append((a // b, f"{_wrap(ea)}/{_wrap(eb)}"))
        pool.append(rng.choice(options))
    value, expression = pool[0]
    return value, _strip_outer(expression)


def _wrap(expression: str) -> str:
    enclosed = expression.startswith("(") and _strip_outer(expression) != expression
    return expression if expression.isdigit() or enclosed else f"({expression})"


def _strip_outer(expression: str) -> str:
    if not (expression.startswith("(") and expression.endswith(")")):
        return expression
    depth = 0
    for i, ch in enumerate(expression):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(expression) - 1:
            return expression
    return expression[1:-1]


def _draw(sample: Any, n: int, seed: int, exclude: frozenset[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        record = sample(rng)
        if record["prompt"] not in exclude:
            out.append(record)
    if not out:
        raise ValueError(
            f"could not draw any record outside the {len(exclude)} excluded prompts; enlarge the task"
        )
    return out
