"""DAPO overlong shaping and dynamic-sampling filter vs direct formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumenrl_core.algorithms import (
    DynamicSamplingState,
    apply_overlong_penalty,
    dynamic_sampling_keep_indices,
    overlong_penalty,
)


@pytest.mark.parametrize(("l_max", "l_buf", "factor"), [(16, 4, 1.0), (20, 20, 0.5), (8, 1, 2.0)])
def test_overlong_penalty_formula(l_max, l_buf, factor):
    lengths = torch.arange(0, l_max + 1)
    got = overlong_penalty(
        lengths, max_response_length=l_max, overlong_buffer_len=l_buf, penalty_factor=factor
    )
    for n, p in zip(lengths.tolist(), got.tolist(), strict=True):
        want = min(-(n - (l_max - l_buf)) / l_buf * factor, 0.0) if n > l_max - l_buf else 0.0
        assert p == pytest.approx(want, abs=1e-7)
    assert got[-1].item() == pytest.approx(-factor)


def test_apply_overlong_penalty_on_last_token():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 8, 7, 0])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    scores = torch.zeros(4, 8)
    scores[torch.arange(3), lengths[:3] - 1] = torch.rand(3, generator=g)
    shaped, metrics = apply_overlong_penalty(scores, mask, max_response_length=8, overlong_buffer_len=4)
    expected = scores.clone()
    expected[1, 7] += -(8 - 4) / 4
    expected[2, 6] += -(7 - 4) / 4
    torch.testing.assert_close(shaped, expected)
    assert metrics["dapo/overlong_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="overlong_buffer_len=0"):
        overlong_penalty(lengths, max_response_length=8, overlong_buffer_len=0)


def test_dynamic_sampling_keeps_only_mixed_groups():
    rng = np.random.default_rng(1)
    uid = np.array(["a", "b", "c", "d"] * 3, dtype=object)
    rng.shuffle(uid)
    scores = rng.random(12)
    scores[uid == "b"] = 1.0  # all correct
    scores[uid == "d"] = 0.0  # all wrong
    keep = dynamic_sampling_keep_indices(torch.tensor(scores), list(uid))
    want = [
        i
        for i, u in enumerate(uid)
        if len({float(s) for s, v in zip(scores, uid, strict=True) if v == u}) > 1
    ]
    assert keep.tolist() == want and keep.dtype == np.int64
    assert dynamic_sampling_keep_indices([1.0, 1.0], ["x", "x"]).size == 0


def test_dynamic_sampling_state_bounds_rounds():
    state = DynamicSamplingState(target_groups=4, max_num_gen_batches=3)
    state.record(1)
    state.record(2)
    assert not state.done
    state.record(0)
    assert state.exhausted and state.done and not state.full
    filled = DynamicSamplingState(target_groups=2, max_num_gen_batches=0)
    filled.record(3)
    assert filled.full and filled.done and filled.metrics()["dapo/kept_groups"] == 3.0
