"""train_rollout_kl: exact KL(train || rollout) and KL(train || q_TIS) against a per-position float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_quant import train_rollout_kl


def _reference(lp_train, lp_roll, mask, clip):
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            p, r = lp_train[b, t].double().exp(), lp_roll[b, t].double().exp()
            q = r if clip is None else torch.minimum(p, clip * r)
            q = q / q.sum()
            total += float((p * (p.log() - q.log())).sum())
            count += 1
    return total / count


@pytest.mark.parametrize("clip", [None, 1.5, 2.0])
def test_matches_per_position_reference(clip):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    lp_train = logits.log_softmax(-1)
    lp_roll = (logits + 0.3 * torch.randn(3, 7, 11, generator=g, dtype=torch.float64)).log_softmax(-1)
    mask = torch.ones(3, 7)
    mask[1, 4:] = 0
    got = float(train_rollout_kl(lp_train, lp_roll, mask, tis_clip=clip))
    assert got == pytest.approx(_reference(lp_train, lp_roll, mask, clip), rel=1e-9, abs=1e-12)


def test_tis_shrinks_the_kl_and_padding_is_ignored():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 32, generator=g)
    lp_train = logits.log_softmax(-1)
    lp_roll = (logits + 0.5 * torch.randn(4, 9, 32, generator=g)).log_softmax(-1)
    mask = torch.ones(4, 9)
    mask[:, 6:] = 0
    before = float(train_rollout_kl(lp_train, lp_roll, mask))
    after = float(train_rollout_kl(lp_train, lp_roll, mask, tis_clip=2.0))
    assert 0 <= after < before
    garbage = lp_roll.clone()
    garbage[:, 6:] = torch.randn(4, 3, 32).log_softmax(-1)
    assert float(train_rollout_kl(lp_train, garbage, mask)) == pytest.approx(before, rel=1e-12)
    # a cap above every ratio leaves q_TIS = p_train: nothing left of the mismatch
    ratio_max = float((lp_train - lp_roll).max().exp())
    assert float(train_rollout_kl(lp_train, lp_roll, mask, tis_clip=2 * ratio_max)) == pytest.approx(0, abs=1e-12)
    assert math.isclose(float(train_rollout_kl(lp_train, lp_train, mask)), 0.0, abs_tol=1e-12)


def test_bad_input_is_named():
    lp = torch.zeros(2, 3, 4).log_softmax(-1)
    with pytest.raises(ValueError, match="tis_clip"):
        train_rollout_kl(lp, lp, torch.ones(2, 3), tis_clip=0.0)
    with pytest.raises(ValueError, match="mask"):
        train_rollout_kl(lp, lp, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        train_rollout_kl(lp[0], lp[0], torch.ones(3))
