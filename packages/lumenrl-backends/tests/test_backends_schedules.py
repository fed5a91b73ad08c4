"""LR schedules: closed-form values at key steps, and the LambdaLR wiring."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_backends.training.schedules import LRSchedule, build_lr_scheduler, lr_multiplier


def test_constant_with_warmup_ramps_linearly_then_holds():
    s = LRSchedule(name="constant", num_training_steps=10, warmup_steps=4)
    assert [lr_multiplier(s, k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier(s, 1000) == 1.0


def test_linear_decays_to_floor_and_stays():
    s = LRSchedule(name="linear", num_training_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert lr_multiplier(s, 0) == pytest.approx(0.5, abs=1e-15)
    assert lr_multiplier(s, 2) == pytest.approx(1.0, abs=1e-15)
    assert lr_multiplier(s, 6) == pytest.approx(1.0 - 0.9 * 0.5, abs=1e-15)  # halfway through decay
    assert lr_multiplier(s, 10) == pytest.approx(0.1, abs=1e-15)
    assert lr_multiplier(s, 50) == pytest.approx(0.1, abs=1e-15)


def test_cosine_values_at_key_steps():
    s = LRSchedule(name="cosine", num_training_steps=10, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(s, 0) == pytest.approx(1.0, abs=1e-15)
    assert lr_multiplier(s, 5) == pytest.approx(0.5, abs=1e-15)
    assert lr_multiplier(s, 10) == pytest.approx(0.0, abs=1e-15)
    floored = LRSchedule(name="cosine", num_training_steps=12, warmup_steps=2, min_lr_ratio=0.2)
    assert lr_multiplier(floored, 7) == pytest.approx(0.2 + 0.8 * 0.5, abs=1e-15)
    quarter = 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_multiplier(floored, 4.5) == pytest.approx(quarter, abs=1e-15)
    assert lr_multiplier(floored, 30) == pytest.approx(0.2, abs=1e-15)


def test_lambda_lr_follows_the_multiplier_per_optimizer_step():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.4)
    s = LRSchedule(name="linear", num_training_steps=8, warmup_steps=3, min_lr_ratio=0.25)
    sched = build_lr_scheduler(opt, s)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.4 * lr_multiplier(s, k) for k in range(10)], abs=1e-12)
    restored = build_lr_scheduler(torch.optim.SGD([p], lr=0.4), s)
    restored.load_state_dict(sched.state_dict())
    assert restored.get_last_lr() == pytest.approx(sched.get_last_lr())


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"name": "step"}, "lr_schedule"),
        ({"num_training_steps": 0}, "num_training_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_bad_schedule_arguments_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LRSchedule(**kwargs)
