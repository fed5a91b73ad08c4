"""Math reward: answer extraction, numeric equivalence, scoring, token placement."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from lumenrl_core.rewards import (
    MathReward,
    answers_match,
    extract_boxed,
    extract_final_answer,
    ground_truth_answer,
    parse_number,
    scores_to_token_level,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("so $\\boxed{\\sqrt{\\frac{3}{4}}}$", "\\sqrt{\\frac{3}{4}}"),
        ("\\fbox{7}", "7"),
        ("work...\n#### 1,000\n", "1,000"),
        ("#### 3\nmore text #### -5", "-5"),
        ("12+7=19", "19"),
        ("19", "19"),
        ("19<|endoftext|>", "19"),
        (" 19 ", "19"),
        ("we get -12 apples", "-12"),
        ("3-5 is computed", "5"),
        ("ratio 3/4", "3/4"),
        ("it is .5 now.", ".5"),
        ("x = 2.5e3.", "2.5e3"),
        ("step2 gives 7", "7"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_boxed_unbalanced_falls_back():
    assert extract_boxed("\\boxed{12") is None
    assert extract_final_answer("\\boxed{12") == "12"  # last number


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("1,000", Fraction(1000)),
        ("-1,234.5", Fraction(-2469, 2)),
        ("0.50", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("-.25", Fraction(-1, 4)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{6}{8}", Fraction(-3, 4)),
        ("$12$", Fraction(12)),
        ("12.", Fraction(12)),
        ("50\\%", Fraction(50)),
        ("\\text{ 7 }", Fraction(7)),
        ("1e3", Fraction(1000)),
        ("1/0", None),
        ("abc", None),
        ("/3", None),
        ("1,2,3", None),
    ],
)
def test_parse_number(answer, value):
    assert parse_number(answer) == value


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("1,000", "1000", True),
        ("0.50", ".5", True),
        ("3/4", "0.75", True),
        ("\\frac{3}{4}", "0.75", True),
        ("-7", "-7.0", True),
        ("-7", "7", False),
        ("0.3333333333333", "1/3", True),
        ("0.333", "1/3", False),
        ("x+1", "x + 1", True),
        ("\\text{Yes}", "yes", True),
        ("19", "91", False),
    ],
)
def test_answers_match(pred, gt, same):
    assert answers_match(pred, gt) is same


def test_answers_match_huge_values_do_not_overflow():
    # a policy sampling random digits writes numbers past float range; the comparison stays exact
    huge = "9" * 400
    assert answers_match(huge, huge) is True
    assert answers_match(huge, "2" + "0" * 400) is False
    assert answers_match("1e400", "1e400") is True and answers_match("1e400", "2e400") is False
    assert parse_number("1e999999999") is None  # not built as 10**999999999
    assert answers_match("1e999999999", "5") is False


def test_ground_truth_forms():
    assert ground_truth_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert ground_truth_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert ground_truth_answer(19) == "19"


def test_math_reward_scores_rows():
    reward = MathReward(format_score=0.1)
    responses = ["19", "\\boxed{19}", "18", "I don't know", "12+7=19", "#### 19.0", "1,9"]
    extra = [{"ground_truth": "19"} for _ in responses]
    scores = reward(["12+7="] * len(responses), responses, extra)
    assert scores == [1.0, 1.0, 0.1, 0.0, 1.0, 1.0, 0.1]
    assert MathReward.probe() is None and MathReward.capabilities == frozenset()


def test_math_reward_errors():
    reward = MathReward()
    with pytest.raises(ValueError, match="prompts=1, responses=2, extra=1"):
        reward(["a"], ["1", "2"], [{"ground_truth": "1"}])
    with pytest.raises(KeyError, match="no 'ground_truth'"):
        reward(["a"], ["1"], [{"answer": "1"}])


def test_scores_to_token_level():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = scores_to_token_level([0.5, -1.0, 3.0, 2.0], mask)
    expected = torch.zeros(4, 4)
    expected[0, 1], expected[1, 3], expected[3, 2] = 0.5, -1.0, 2.0
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="got 1 scores for 4 rows"):
        scores_to_token_level([1.0], mask)
