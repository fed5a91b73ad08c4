"""Rewards: verifiable math and countdown scorers, user reward functions, token placement.

Plugins (group ``lumenrl.rewards``): ``math`` -> ``MathReward``, ``countdown`` ->
``CountdownReward``. Every reward follows the ``RewardFn`` protocol
``(prompts, responses, extra) -> list[float]``; ``extra[i]`` carries ``ground_truth`` (and for
countdown ``numbers`` / ``target``). ``reward.function="module:fn"`` loads a user function.
"""

from lumenrl_core.rewards.answers import answers_match, extract_boxed, extract_final_answer, parse_number
from lumenrl_core.rewards.countdown import (
    CountdownReward,
    countdown_score,
    evaluate_expression,
    extract_expression,
)
from lumenrl_core.rewards.loader import UserReward, load_reward_function
from lumenrl_core.rewards.math_reward import MathReward, ground_truth_answer, math_score

__all__ = [
    "answers_match",
    "extract_boxed",
    "extract_final_answer",
    "parse_number",
    "CountdownReward",
    "countdown_score",
    "evaluate_expression",
    "extract_expression",
    "UserReward",
    "load_reward_function",
    "MathReward",
    "ground_truth_answer",
    "math_score",
    "scores_to_token_level",
]


def __getattr__(name: str):  # torch-level helper imported on first use (config commands stay torch-free)
    if name == "scores_to_token_level":
        from lumenrl_core.rewards.token_level import scores_to_token_level

        return scores_to_token_level
    raise AttributeError(f"module 'lumenrl_core.rewards' has no attribute {name!r}")
