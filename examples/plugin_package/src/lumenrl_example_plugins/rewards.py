"""The ``concise`` reward: exact match of the final answer, less a penalty per extra character.

For a task whose response should be the bare answer (the bundled arithmetic task: ``"12+7="`` ->
``"19"``). With a = the reference answer (``extra[i]["ground_truth"]``, a solution ending in
``#### x`` reduced to ``x``), p = the response's final answer (LumenRL's math extraction) and
``excess = max(0, len(response.strip()) - len(a))`` characters beyond the bare answer:

    score = max(format_score, 1 - length_penalty * excess)   if p matches a (numerically or as text)
          = format_score                                     if p exists but does not match
          = 0                                                if the response has no answer

so a correct answer never scores below a wrong one, and among correct answers the bare one scores
highest (1). ``format_score`` is the run's ``reward.format_score``; ``length_penalty`` a constructor
argument (0.1 per character). Its spec requires the run feature ``task:arithmetic``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lumenrl_core.rewards import answers_match, extract_final_answer, ground_truth_answer
from lumenrl_example_plugins import plugin_manifest as manifest

__all__ = ["concise_score", "ConciseReward"]


def concise_score(response: str, ground_truth: Any, *, format_score: float = 0.0, length_penalty: float = 0.1) -> float:
    """Score one response (see the module docstring)."""
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    answer = ground_truth_answer(ground_truth)
    if not answers_match(predicted, answer):
        return format_score
    excess = max(0, len(response.strip()) - len(answer))
    return max(format_score, 1.0 - length_penalty * excess)


class ConciseReward:
    """``concise`` reward plugin (``lumenrl.rewards``): ``(prompts, responses, extra) -> scores``."""

    capabilities = manifest.CONCISE.capabilities
    requires = manifest.CONCISE.requires

    def __init__(self, *, format_score: float = 0.0, length_penalty: float = 0.1) -> None:
        if length_penalty < 0:
            raise ValueError(f"length_penalty={length_penalty!r} is invalid: allowed >= 0")
        self.format_score = format_score
        self.length_penalty = length_penalty

    @classmethod
    def probe(cls) -> str | None:
        return manifest.CONCISE.unavailable_reason()

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], extra: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        if not len(prompts) == len(responses) == len(extra):
            raise ValueError(f"reward inputs differ in length: prompts={len(prompts)}, "
                             f"responses={len(responses)}, extra={len(extra)}")
        for i, row in enumerate(extra):
            if "ground_truth" not in row:
                raise KeyError(f"reward extra row {i} has no 'ground_truth' (keys: {sorted(row)})")
        return [concise_score(r, row["ground_truth"], format_score=self.format_score,
                              length_penalty=self.length_penalty) for r, row in zip(responses, extra)]
