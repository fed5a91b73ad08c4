"""Advantage estimators vs direct float64 per-element Python formulas on fresh random data."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lumenrl_core.algorithms import (
    DrGRPOAdvantage,
    GAEAdvantage,
    GRPOAdvantage,
    RLOOAdvantage,
    gae_advantage,
    grpo_outcome_advantage,
    rloo_outcome_advantage,
)

TOL = 1e-5


def _random_batch(seed: int, n_groups: int = 4, group: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    b = n_groups * group
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # right-padded
    scores = torch.randn(b, generator=g)
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = scores
    # a little noise off the last token so the masked sum matters; garbage in padding
    rewards += 0.1 * torch.randn(b, t, generator=g) * mask
    rewards += 100.0 * (1 - mask)
    perm = torch.randperm(b, generator=g)  # groups interleaved, not contiguous
    uid = np.array([f"p{i // group}" for i in range(b)], dtype=object)[perm.numpy()]
    return rewards[perm], mask[perm], uid


def _ref_scores(rewards, mask):
    return [
        sum(float(rewards[i, t]) for t in range(rewards.shape[1]) if mask[i, t] > 0)
        for i in range(len(rewards))
    ]


def _ref_outcome(rewards, mask, uid, kind):
    scores = _ref_scores(rewards, mask)
    out = []
    for i, u in enumerate(uid):
        members = [scores[j] for j in range(len(uid)) if uid[j] == u]
        n = len(members)
        if n == 1:
            out.append(0.0)
        elif kind == "grpo":
            out.append((scores[i] - statistics.fmean(members)) / (statistics.stdev(members) + 1e-6))
        elif kind == "drgrpo":
            out.append(scores[i] - statistics.fmean(members))
        else:  # rloo: leave-one-out mean
            out.append(scores[i] - (sum(members) - scores[i]) / (n - 1))
    return torch.tensor(out, dtype=torch.float64)[:, None] * mask.double()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_outcome_advantages_match_reference(seed, kind):
    rewards, mask, uid = _random_batch(seed)
    if kind == "rloo":
        adv, ret = rloo_outcome_advantage(rewards, mask, list(uid))
    else:
        adv, ret = grpo_outcome_advantage(rewards, mask, list(uid), norm_adv_by_std=kind == "grpo")
    ref = _ref_outcome(rewards, mask, uid, kind)
    assert adv.dtype == rewards.dtype and adv.shape == rewards.shape
    torch.testing.assert_close(adv.double(), ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(ret, adv)
    assert torch.all(adv[mask == 0] == 0)


def test_singleton_groups_and_ties_give_zero():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2).repeat(2, 1)
    uid = ["a", "a", "a", "solo"]
    for fn in (grpo_outcome_advantage, rloo_outcome_advantage):
        adv, _ = fn(rewards, mask, uid)
        assert torch.count_nonzero(adv) == 0


def test_grpo_two_member_group_closed_form():
    # r = (1, 0): mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / (0.7071 + 1e-6)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    adv, _ = grpo_outcome_advantage(rewards, torch.ones(2, 2), [7, 7])
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([expected, -expected]))


def _ref_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    raw = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        valid = [k for k in range(t) if mask[i, k] > 0]
        nxt_v, nxt_a = 0.0, 0.0
        for k in reversed(valid):
            delta = float(rewards[i, k]) + gamma * nxt_v - float(values[i, k])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[i, k])
            raw[i, k] = nxt_a
    flat = [float(raw[i, k]) for i in range(b) for k in range(t) if mask[i, k] > 0]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    adv = (raw - mean) / math.sqrt(std**2 + 1e-8) * mask.double()
    returns = (raw + values.double()) * mask.double()
    return adv, returns


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_with_holes_in_mask(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.3).float()  # interior holes too
    mask[:, 0] = 1.0
    adv, ret = gae_advantage(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, atol=TOL, rtol=TOL)
    torch.testing.assert_close(ret.double(), ref_ret, atol=TOL, rtol=TOL)


def _fake_proto(**tensors):
    uid = tensors.pop("uid")
    return SimpleNamespace(batch=tensors, non_tensor_batch={"uid": uid}, meta_info={})


def test_plugin_classes_read_the_batch():
    rewards, mask, uid = _random_batch(5)
    batch = _fake_proto(token_level_rewards=rewards, response_mask=mask, uid=uid)
    pairs = [
        (GRPOAdvantage(), "grpo"),
        (GRPOAdvantage(norm_adv_by_std=False), "drgrpo"),
        (DrGRPOAdvantage(), "drgrpo"),
        (RLOOAdvantage(), "rloo"),
    ]
    for est, kind in pairs:
        adv, _ = est(batch)
        torch.testing.assert_close(adv.double(), _ref_outcome(rewards, mask, uid, kind), atol=TOL, rtol=TOL)
        assert est.capabilities == frozenset() and est.probe() is None
    batch.batch["values"] = torch.randn_like(rewards)
    adv, ret = GAEAdvantage(gamma=0.99, lam=0.95)(batch)
    ref_adv, ref_ret = _ref_gae(rewards, batch.batch["values"], mask, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), ref_adv, atol=TOL, rtol=TOL)


def test_gae_errors_name_the_problem():
    with pytest.raises(ValueError, match="lam=1.5"):
        GAEAdvantage(lam=1.5)
    batch = _fake_proto(token_level_rewards=torch.ones(1, 2), response_mask=torch.ones(1, 2), uid=["a"])
    with pytest.raises(KeyError, match="values"):
        GAEAdvantage()(batch)
    with pytest.raises(ValueError, match="uid has 3 entries"):
        grpo_outcome_advantage(torch.ones(2, 2), torch.ones(2, 2), ["a", "b", "c"])
