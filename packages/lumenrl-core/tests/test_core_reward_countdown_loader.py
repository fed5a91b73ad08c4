"""Countdown reward (safe ast evaluation, number usage) and the user reward loader."""

from __future__ import annotations

import sys
import textwrap
from fractions import Fraction

import pytest

from lumenrl_core.rewards import (
    CountdownReward,
    countdown_score,
    evaluate_expression,
    extract_expression,
    load_reward_function,
)

NUMS, TARGET = [3, 5, 2], 16


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<answer>(3+5)*2</answer>", 1.0),
        ("think... <answer>(3 + 5) * 2</answer>", 1.0),
        ("<answer>3+5</answer> no wait <answer>2*(5+3)</answer>", 1.0),
        ("\\boxed{(3+5)*2}", 1.0),
        ("(3+5)*2 = 16", 1.0),
        ("Let me try.\n(5+3)*2", 1.0),
        ("<answer>3*5+2</answer>", 0.1),  # valid, wrong value
        ("<answer>(3+5)*2*1</answer>", 0.1),  # 1 not given
        ("<answer>(3+3)*2</answer>", 0.1),  # 3 used twice
        ("<answer>8*2</answer>", 0.1),  # numbers not given
        ("<answer>3+5</answer>", 0.1),  # 2 unused
        ("<answer>16</answer>", 0.1),
        ("<answer>__import__('os').system('x')</answer>", 0.0),
        ("<answer>3**5</answer>", 0.0),
        ("<answer>-3+5*2</answer>", 0.0),  # unary minus not allowed
        ("<answer>3.0+5+2</answer>", 0.0),
        ("<answer>(3+5)/(2-2)</answer>", 0.0),
        ("<answer>(3+5</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_score(response, score):
    assert countdown_score(response, NUMS, TARGET, format_score=0.1) == score


def test_division_is_exact_and_subset_mode():
    assert evaluate_expression("(6/4)*4") == (Fraction(6), [6, 4, 4])
    assert countdown_score("<answer>7/2*4</answer>", [7, 2, 4], 14) == 1.0  # 3.5 * 4, exact
    assert countdown_score("<answer>3+5</answer>", NUMS, 8, use_all_numbers=False) == 1.0
    assert countdown_score("<answer>3+5+5</answer>", NUMS, 13, use_all_numbers=False) == 0.0
    assert evaluate_expression("1" + "+1" * 150) is None  # length bound
    assert extract_expression("\n\n") is None


def test_countdown_reward_reads_extra_rows():
    reward = CountdownReward(format_score=0.1)
    extra = [
        {"numbers": NUMS, "target": TARGET},
        {"ground_truth": {"numbers": [1, 2], "target": 3}},
        {"numbers": NUMS, "target": 8, "use_all_numbers": False},
    ]
    assert reward(["p"] * 3, ["<answer>(3+5)*2</answer>", "<answer>2-1</answer>", "3+5"], extra) == [
        1.0,
        0.1,
        1.0,
    ]
    with pytest.raises(TypeError, match="needs 'numbers' and 'target'"):
        reward(["p"], ["1"], [{"ground_truth": "16"}])


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    src = textwrap.dedent(
        """
        THRESHOLD = 3

        def length_reward(prompts, responses, extra):
            return [float(len(r) > THRESHOLD) for r in responses]

        def bad_length(prompts, responses, extra):
            return [1.0]

        def not_numbers(prompts, responses, extra):
            return ["high" for _ in responses]
        """
    )
    (tmp_path / "my_rewards_mod.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards_mod", None)


def test_load_user_reward_module_and_file(user_module):
    fn = load_reward_function("my_rewards_mod:length_reward")
    assert fn(["a", "b"], ["long text", "ab"], [{}, {}]) == [1.0, 0.0]
    from_file = load_reward_function(f"{user_module / 'my_rewards_mod.py'}:length_reward")
    assert from_file(["a"], ["abcd"], [{}]) == [1.0]


def test_load_user_reward_errors(user_module):
    with pytest.raises(ValueError, match="expected 'module:function'"):
        load_reward_function("my_rewards_mod.length_reward")
    with pytest.raises(ModuleNotFoundError, match="module 'no_such_mod_xyz' not found"):
        load_reward_function("no_such_mod_xyz:fn")
    with pytest.raises(AttributeError, match="did you mean 'length_reward'"):
        load_reward_function("my_rewards_mod:length_rewards")
    with pytest.raises(TypeError, match="'THRESHOLD' is a int, not callable"):
        load_reward_function("my_rewards_mod:THRESHOLD")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_function(f"{user_module / 'missing.py'}:fn")
    with pytest.raises(ValueError, match="returned 1 scores for 2 responses"):
        load_reward_function("my_rewards_mod:bad_length")(["a", "b"], ["x", "y"], [{}, {}])
    with pytest.raises(TypeError, match="must return a list of numbers"):
        load_reward_function("my_rewards_mod:not_numbers")(["a"], ["x"], [{}])
