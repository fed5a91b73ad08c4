"""Policy loss, aggregation, KL, value loss and logits helpers vs float64 per-element formulas."""

from __future__ import annotations

import math

import pytest
import torch

from lumenrl_core.algorithms import (
    LOSS_AGG_MODES,
    PPOClipLoss,
    agg_loss,
    apply_kl_penalty,
    clipped_value_loss,
    count_tokens_and_seqs,
    entropy_from_logits,
    kl_estimate,
    kl_loss,
    log_probs_from_logits,
    masked_mean,
    masked_whiten,
    ppo_clip_loss,
)

TOL = 1e-5


def _data(seed: int, b: int = 6, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    new = old + 0.4 * torch.randn(b, t, generator=g)  # ratios well outside [0.8, 1.28]
    adv = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    mask[0] = 0.0  # one fully padded row
    return new, old, adv, mask


def _ref_agg(loss, mask, mode, max_len=None):
    rows = [[float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t] > 0] for i in range(loss.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / len(rows) / (max_len or loss.shape[1])


def _ref_ppo_token(lp, olp, a, lo, hi, c):
    ratio = math.exp(min(max(lp - olp, -20.0), 20.0))
    clip = max(-a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi))
    if a < 0 and c is not None:
        return min(clip, -a * c)
    return clip


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("lo", "hi", "c"), [(0.2, 0.28, 3.0), (0.2, 0.2, None), (0.1, 0.3, 1.5)])
def test_ppo_clip_matches_reference(seed, mode, lo, hi, c):
    new, old, adv, mask = _data(seed)
    isw = 0.5 + torch.rand(new.shape, generator=torch.Generator().manual_seed(seed + 9))
    loss, metrics = ppo_clip_loss(
        new, old, adv, mask, isw, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c, loss_agg_mode=mode
    )
    b, t = new.shape
    ref_mat = torch.tensor(
        [
            [
                _ref_ppo_token(float(new[i, k]), float(old[i, k]), float(adv[i, k]), lo, hi, c)
                for k in range(t)
            ]
            for i in range(b)
        ],
        dtype=torch.float64,
    )
    ref = _ref_agg(ref_mat * isw.double(), mask, mode)
    assert abs(loss.item() - ref) <= TOL * (1 + abs(ref))
    assert metrics["actor/pg_loss"] == pytest.approx(loss.item())
    # diagnostics, per valid token
    valid = [(i, k) for i in range(b) for k in range(t) if mask[i, k] > 0]
    n_clip = n_lower = 0
    kl = 0.0
    for i, k in valid:
        r = math.exp(float(new[i, k]) - float(old[i, k]))
        a = float(adv[i, k])
        n_clip += -a * min(max(r, 1 - lo), 1 + hi) > -a * r
        clip_term = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
        n_lower += c is not None and a < 0 and clip_term > -a * c
        kl += float(old[i, k]) - float(new[i, k])
    assert metrics["actor/clip_frac"] == pytest.approx(n_clip / len(valid), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(n_lower / len(valid), abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(kl / len(valid), abs=1e-5)
    assert 0 < metrics["actor/clip_frac"] < 1


def test_ppo_clip_log_ratio_clamped_and_gradient_finite():
    old = torch.zeros(1, 3)
    new = torch.tensor([[30.0, -30.0, 0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, _ = ppo_clip_loss(new, old, adv, torch.ones(1, 3), clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    # token 0: ratio e^20 clipped at 1.2 -> no gradient; token 2 inside the band -> gradient
    assert new.grad[0, 0] == 0 and new.grad[0, 2] != 0


def test_masked_tokens_do_not_matter():
    new, old, adv, mask = _data(3)
    loss_fn = PPOClipLoss(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean")
    loss_a, _ = loss_fn(new, old, adv, mask)
    garbage = torch.where(mask > 0, new, torch.full_like(new, 1e4))
    loss_b, _ = loss_fn(garbage, old, adv * mask + 1e3 * (1 - mask), mask)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    g = torch.Generator().manual_seed(11)
    loss_mat = torch.randn(12, 10, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, 11, (12,), generator=g)  # includes empty rows
    mask = (torch.arange(10)[None, :] < lengths[:, None]).double()
    full = agg_loss(loss_mat, mask, mode, max_len=16)
    assert full.item() == pytest.approx(_ref_agg(loss_mat, mask, mode, max_len=16), rel=1e-12)
    n_tok, n_seq = count_tokens_and_seqs(mask)
    for split in ([3, 4, 5], [1] * 12, [12]):
        parts = zip(loss_mat.split(split), mask.split(split), strict=True)
        total = sum(
            agg_loss(lm, m, mode, global_tokens=n_tok, global_seqs=n_seq, max_len=16) for lm, m in parts
        )
        assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)


def test_micro_batch_gradients_accumulate_to_full_batch_gradient():
    new, old, adv, mask = _data(4)
    new = new.double()
    loss_fn = PPOClipLoss(loss_agg_mode="token-mean")
    full_param = new.clone().requires_grad_(True)
    loss_fn(full_param, old.double(), adv.double(), mask)[0].backward()
    micro_param = new.clone().requires_grad_(True)
    n_tok, n_seq = count_tokens_and_seqs(mask)
    for idx in (slice(0, 2), slice(2, 5), slice(5, 6)):
        loss, _ = loss_fn(
            micro_param[idx],
            old[idx].double(),
            adv[idx].double(),
            mask[idx],
            global_tokens=n_tok,
            global_seqs=n_seq,
        )
        loss.backward()
    torch.testing.assert_close(micro_param.grad, full_param.grad, rtol=1e-12, atol=1e-14)


def test_agg_and_loss_errors_list_allowed_values():
    with pytest.raises(ValueError, match="loss_agg_mode='mean'.*token-mean"):
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="loss_agg_mode='sum'"):
        PPOClipLoss(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="clip_ratio_low=1.2"):
        PPOClipLoss(clip_ratio_low=1.2)
    assert agg_loss(torch.ones(2, 2), torch.zeros(2, 2), "token-mean").item() == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    g = torch.Generator().manual_seed(5)
    lp, ref = -3 * torch.rand(4, 6, generator=g), -3 * torch.rand(4, 6, generator=g)
    ref[0, 0] = lp[0, 0] + 15.0  # exp(-d) huge: k3 must clamp at 10
    out = kl_estimate(lp, ref, kind)
    for i in range(4):
        for k in range(6):
            d = float(lp[i, k]) - float(ref[i, k])
            want = {"k1": d, "k2": d * d / 2}.get(kind, min(max(math.exp(-d) + d - 1, -10.0), 10.0))
            assert float(out[i, k]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    if kind in ("k3", "low_var_kl"):
        assert out[0, 0] == 10.0 and (out >= 0).all()
    with pytest.raises(ValueError, match="kind='k4'"):
        kl_estimate(lp, ref, "k4")


def test_kl_loss_and_penalty():
    g = torch.Generator().manual_seed(6)
    lp, ref = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    loss, metrics = kl_loss(lp, ref, mask, kind="k2", loss_agg_mode="token-mean")
    d = (lp - ref).double()
    ref_loss = float((0.5 * d**2 * mask).sum() / mask.sum())
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6) and metrics["actor/kl"] == pytest.approx(
        ref_loss, rel=1e-6
    )
    scores = torch.zeros(3, 5)
    scores[0, 2], scores[1, 4], scores[2, 0] = 1.0, 0.0, 1.0
    rewards, m = apply_kl_penalty(scores, lp, ref, mask, coef=0.1, kind="k1")
    torch.testing.assert_close(
        rewards.double(), scores.double() - 0.1 * d * mask.double(), atol=1e-6, rtol=1e-6
    )
    assert m["kl_in_reward/coef"] == 0.1


def test_clipped_value_loss_matches_reference():
    g = torch.Generator().manual_seed(7)
    v, v_old, ret = (torch.randn(4, 6, generator=g) for _ in range(3))
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, metrics = clipped_value_loss(v, v_old, ret, mask, cliprange_value=0.2, loss_agg_mode="token-mean")
    terms, clipped = [], 0
    for i in range(4):
        for k in range(6):
            if mask[i, k] == 0:
                continue
            vi, vo, r = float(v[i, k]), float(v_old[i, k]), float(ret[i, k])
            vc = vo + min(max(vi - vo, -0.2), 0.2)
            terms.append(max((vi - r) ** 2, (vc - r) ** 2))
            clipped += (vc - r) ** 2 > (vi - r) ** 2
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipped / len(terms), abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 5, 1024])
def test_entropy_and_log_probs_from_logits(chunk_rows):
    g = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(2, 7, 11, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    z = logits.double()
    p = torch.softmax(z, -1)
    ref_ent = -(p * torch.log(p)).sum(-1)
    ent = entropy_from_logits(logits, chunk_rows=chunk_rows)
    assert ent.dtype == torch.float32 and ent.shape == (2, 7)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    lp = log_probs_from_logits(logits, labels, temperature=0.7, chunk_rows=chunk_rows)
    ref_lp = torch.log_softmax(z / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)


def test_logits_helpers_backprop_through_chunks():
    g = torch.Generator().manual_seed(9)
    base = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    chunked = base.clone().requires_grad_(True)
    full = base.clone().requires_grad_(True)
    entropy_from_logits(chunked, chunk_rows=5).sum().backward()
    entropy_from_logits(full, chunk_rows=1024).sum().backward()
    torch.testing.assert_close(chunked.grad, full.grad)


def test_masked_helpers():
    g = torch.Generator().manual_seed(10)
    x, mask = (
        torch.randn(5, 4, generator=g, dtype=torch.float64),
        (torch.rand(5, 4, generator=g) > 0.4).double(),
    )
    vals = [float(x[i, k]) for i in range(5) for k in range(4) if mask[i, k] > 0]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    assert masked_mean(x, mask).item() == pytest.approx(mean)
    w = masked_whiten(x, mask)
    torch.testing.assert_close(w, (x - mean) / math.sqrt(var + 1e-8))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("seed", [20, 21])
def test_unsynced_metrics_are_the_same_values_left_as_tensors(seed):
    """``sync_metrics=False``: each metric a 0-dim tensor equal to the float the default returns."""
    new, old, adv, mask = _data(seed)
    g = torch.Generator().manual_seed(seed)
    ref, values = -torch.rand(new.shape, generator=g), torch.randn(new.shape, generator=g)
    n_tok, n_seq = count_tokens_and_seqs(mask)
    calls = (
        lambda **kw: ppo_clip_loss(new, old, adv, mask, global_tokens=n_tok, global_seqs=n_seq, **kw),
        lambda **kw: PPOClipLoss(clip_ratio_c=None)(new, old, adv, mask, global_tokens=n_tok, **kw),
        lambda **kw: kl_loss(new, ref, mask, global_tokens=n_tok, **kw),
        lambda **kw: clipped_value_loss(values, old, adv, mask, global_tokens=n_tok, **kw),
    )
    for call in calls:
        loss_host, host = call()
        loss_dev, dev = call(sync_metrics=False)
        assert torch.equal(loss_host, loss_dev) and host.keys() == dev.keys()
        for key, value in host.items():
            assert isinstance(value, float), key
            assert isinstance(dev[key], torch.Tensor) and dev[key].dim() == 0 and not dev[key].requires_grad, key
            assert float(dev[key]) == value, key


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_python_count_and_a_tensor_count_give_the_same_loss(mode):
    """The global counts may come as Python numbers (kept on the host) or tensors; the loss is the same."""
    g = torch.Generator().manual_seed(30)
    loss_mat = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=g) > 0.4).double()
    n_tok, n_seq = count_tokens_and_seqs(mask)
    as_numbers = agg_loss(loss_mat, mask, mode, global_tokens=n_tok, global_seqs=n_seq)
    as_tensors = agg_loss(loss_mat, mask, mode, global_tokens=torch.tensor(n_tok), global_seqs=torch.tensor(n_seq))
    assert as_numbers.item() == pytest.approx(as_tensors.item(), rel=1e-15)
    assert as_numbers.item() == pytest.approx(_ref_agg(loss_mat, mask, mode), rel=1e-12)
    empty = agg_loss(loss_mat, torch.zeros_like(mask), mode, global_tokens=0, global_seqs=0)
    assert empty.item() == 0.0  # a zero count is clamped to 1: an empty batch gives 0, not nan
