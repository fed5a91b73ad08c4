"""The ``math`` reward: 1 for a correct final answer, ``format_score`` for a wrong one, else 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lumenrl_core import plugin_manifest as manifest
from lumenrl_core.rewards.answers import answers_match, extract_boxed, extract_final_answer

__all__ = ["MathReward", "math_score", "ground_truth_answer"]


def ground_truth_answer(ground_truth: Any) -> str:
    """The answer inside a ground truth: a bare value, or a full solution ending in ``#### x`` / ``\\boxed{x}``."""
    text = str(ground_truth).strip()
    if "####" in text or "\\boxed" in text or "\\fbox" in text:
        return extract_boxed(text) or text.rsplit("####", 1)[-1].strip()
    return text


def math_score(
    response: str, ground_truth: Any, *, format_score: float = 0.0, correct_score: float = 1.0
) -> float:
    """Score one response: ``correct_score`` if its final answer matches, ``format_score`` if it
    has an extractable but wrong answer, 0 if it has none."""
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    return correct_score if answers_match(predicted, ground_truth_answer(ground_truth)) else format_score


class MathReward:
    """Verifiable math reward plugin; ``extra[i]["ground_truth"]`` holds the reference answer."""

    capabilities = manifest.MATH.capabilities

    def __init__(self, *, format_score: float = 0.0, correct_score: float = 1.0) -> None:
        self.format_score = format_score
        self.correct_score = correct_score

    @classmethod
    def probe(cls) -> str | None:
        return manifest.MATH.unavailable_reason()

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], extra: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        _check_lengths(prompts, responses, extra)
        return [
            math_score(
                resp,
                _field(row, "ground_truth", i),
                format_score=self.format_score,
                correct_score=self.correct_score,
            )
            for i, (resp, row) in enumerate(zip(responses, extra, strict=True))
        ]


def _check_lengths(prompts: Sequence[Any], responses: Sequence[Any], extra: Sequence[Any]) -> None:
    if not len(prompts) == len(responses) == len(extra):
        raise ValueError(
            f"reward inputs differ in length: prompts={len(prompts)}, responses={len(responses)}, extra={len(extra)}"
        )


def _field(row: Mapping[str, Any], key: str, index: int) -> Any:
    if key not in row:
        raise KeyError(f"reward extra row {index} has no {key!r} (keys: {sorted(row)})")
    return row[key]
