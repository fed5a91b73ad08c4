"""Rollout correction vs a direct float64 per-element Python implementation of the formulas."""

from __future__ import annotations

import dataclasses
import importlib
import math
import statistics
from importlib.metadata import entry_points

import pytest
import torch

from lumenrl_quant.correction import (
    MISGeometric,
    MISSequence,
    MISToken,
    SeqMIS,
    TISSequence,
    TISToken,
    apply_is_weights,
    kl_rejection_mask,
    mis_geometric_mask,
    mis_sequence_mask,
    mis_token_mask,
    rollout_correction_metrics,
    seq_mis,
    tis_sequence_weights,
    tis_token_weights,
)

SEEDS = [0, 1, 2]
CLASSES = {
    "tis_token": TISToken,
    "tis_seq": TISSequence,
    "mis_token": MISToken,
    "mis_seq": MISSequence,
    "mis_geo": MISGeometric,
    "seq_mis": SeqMIS,
}


# ---------------------------------------------------------------- float64 reference (per element)


def make_batch(seed: int, batch: int = 6, length: int = 12, spread: float = 0.5, dtype=torch.float64):
    """Random log-probs with right-padded masks of random lengths (one empty row)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3.0
    old = rollout + spread * torch.randn(batch, length, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    lengths[-1] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float32)
    return old.to(dtype), rollout.to(dtype), mask


def ref_rows(old, rollout, mask):
    """Per row: the list of clamped float64 log ratios of its valid tokens (and their positions)."""
    o, r, m = (t.double().tolist() for t in (old, rollout, mask))
    rows = []
    for b in range(len(o)):
        cols = [t for t in range(len(o[b])) if m[b][t] != 0]
        rows.append((cols, [min(max(o[b][t] - r[b][t], -20.0), 20.0) for t in cols]))
    return rows


def ref_fill(shape, rows, per_row):
    """Write per_row(lrs) -> list of per-token values into a zero (B, T) float64 tensor."""
    out = [[0.0] * shape[1] for _ in range(shape[0])]
    for b, (cols, lrs) in enumerate(rows):
        for t, value in zip(cols, per_row(lrs)):
            out[b][t] = value
    return torch.tensor(out, dtype=torch.float64)


def seq_lr(lrs):
    return min(max(sum(lrs), -20.0), 20.0)


def geo_lr(lrs):
    return sum(lrs) / len(lrs) if lrs else 0.0


def ref_quantile(values, percent):
    """Linear interpolation between the order statistics around rank ``percent / 100 * (n - 1)``."""
    ordered = sorted(values)
    rank = percent / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def in_band(lr, lo, hi):
    return 1.0 if lo <= math.exp(lr) <= hi else 0.0


def ref_kl(lr, k):
    d = -lr
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[k]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=1e-12, atol=1e-12):
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- functions vs reference


@pytest.mark.parametrize("seed", SEEDS)
def test_tis_token_and_sequence_match_reference(seed):
    old, rollout, mask = make_batch(seed)
    rows = ref_rows(old, rollout, mask)
    for clip in (2.0, 1.2):
        tok = ref_fill(old.shape, rows, lambda lrs, c=clip: [min(math.exp(x), c) for x in lrs])
        seq = ref_fill(old.shape, rows, lambda lrs, c=clip: [min(math.exp(seq_lr(lrs)), c)] * len(lrs))
        assert_close(tis_token_weights(old, rollout, mask, clip=clip), tok)
        assert_close(tis_sequence_weights(old, rollout, mask, clip=clip), seq)
    assert (tok == 1.2).any() and (tok < 1.2).any()  # the data exercises the cap


@pytest.mark.parametrize("seed", SEEDS)
def test_mis_masks_match_reference(seed):
    old, rollout, mask = make_batch(seed, spread=0.3)
    rows = ref_rows(old, rollout, mask)
    lo, hi = 0.7, 1.4
    tok = ref_fill(old.shape, rows, lambda lrs: [in_band(x, lo, hi) for x in lrs])
    seq = ref_fill(old.shape, rows, lambda lrs: [in_band(seq_lr(lrs), lo, hi)] * len(lrs))
    geo = ref_fill(old.shape, rows, lambda lrs: [in_band(geo_lr(lrs), 0.95, 1.05)] * len(lrs))
    assert_close(mis_token_mask(old, rollout, mask, low=lo, high=hi), tok)
    assert_close(mis_sequence_mask(old, rollout, mask, low=lo, high=hi), seq)
    assert_close(mis_geometric_mask(old, rollout, mask, low=0.95, high=1.05), geo)
    assert 0 < tok.sum() < mask.sum().item()  # some tokens rejected, some kept


@pytest.mark.parametrize("seed", SEEDS)
def test_seq_mis_matches_reference(seed):
    old, rollout, mask = make_batch(seed, spread=0.15)
    rows = ref_rows(old, rollout, mask)
    keep = ref_fill(old.shape, rows, lambda lrs: [in_band(seq_lr(lrs), 0.5, 2.0)] * len(lrs))
    weights = ref_fill(
        old.shape, rows, lambda lrs: [math.exp(seq_lr(lrs)) * in_band(seq_lr(lrs), 0.5, 2.0)] * len(lrs)
    )
    w, k = seq_mis(old, rollout, mask)
    assert_close(w, weights)
    assert_close(k, keep)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_rejection_matches_reference(seed, estimator):
    old, rollout, mask = make_batch(seed, spread=0.4)
    rows = ref_rows(old, rollout, mask)
    seq_kl = [sum(ref_kl(x, estimator) for x in lrs) / max(len(lrs), 1) for _, lrs in rows]
    threshold = statistics.median(seq_kl)
    expected = ref_fill(
        old.shape, rows, lambda lrs: [1.0 if geo_kl(lrs, estimator) <= threshold else 0.0] * len(lrs)
    )
    got = kl_rejection_mask(old, rollout, mask, estimator=estimator, threshold=threshold)
    assert_close(got, expected)
    assert 0 < got.sum() < mask.sum()


def geo_kl(lrs, estimator):
    return sum(ref_kl(x, estimator) for x in lrs) / max(len(lrs), 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_metrics_match_reference(seed):
    old, rollout, mask = make_batch(seed, spread=0.6)
    rows = ref_rows(old, rollout, mask)
    lrs = [x for _, row in rows for x in row]
    weights, keep, metrics = TISToken(clip=2.0, extreme_tau=1.5)(old, rollout, mask)
    ratios = [math.exp(x) for x in lrs]
    expected = {
        "is_ratio_mean": sum(ratios) / len(ratios),
        "is_ratio_max": max(ratios),
        "is_weight_mean": sum(min(r, 2.0) for r in ratios) / len(ratios),
        **{f"is_weight_p{q}": ref_quantile([min(r, 2.0) for r in ratios], q) for q in (5, 50, 95)},
        "clipped_frac": sum(r > 2.0 for r in ratios) / len(ratios),
        "masked_frac": 0.0,
        "kl_k1": sum(-x for x in lrs) / len(lrs),
        "kl_k3": sum(math.exp(x) - 1 - x for x in lrs) / len(lrs),
        "extreme_token_frac": sum(max(r, 1 / r) > 1.5 for r in ratios) / len(ratios),
    }
    assert set(metrics) == {"rollout_correction/" + k for k in expected}
    for key, value in expected.items():
        assert metrics["rollout_correction/" + key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert expected["clipped_frac"] > 0 and expected["extreme_token_frac"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_weight_quantiles_are_over_kept_tokens(seed):
    old, rollout, mask = make_batch(seed, spread=0.3)
    weights, keep, metrics = SeqMIS(mask_low=0.5, mask_high=2.0)(old, rollout, mask)
    kept = [w for w, k in zip(weights.flatten().tolist(), keep.flatten().tolist()) if k]
    assert 0 < len(kept) < mask.sum().item()  # some rows rejected: their zero weights are left out
    for q in (5, 50, 95):
        assert metrics[f"rollout_correction/is_weight_p{q}"] == pytest.approx(ref_quantile(kept, q), rel=1e-9)
    _, _, unweighted = MISToken()(old, rollout, mask)
    _, _, empty = TISToken()(old, rollout, torch.zeros_like(mask))
    for q in (5, 50, 95):
        assert unweighted[f"rollout_correction/is_weight_p{q}"] == empty[f"rollout_correction/is_weight_p{q}"] == 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_frac_counts_rejected_valid_tokens(seed):
    old, rollout, mask = make_batch(seed, spread=0.3)
    _, keep, metrics = MISToken(mask_low=0.8, mask_high=1.25)(old, rollout, mask)
    valid = mask.sum().item()
    expected = (valid - keep.sum().item()) / valid
    assert metrics["rollout_correction/masked_frac"] == pytest.approx(expected, rel=1e-9)
    assert expected > 0


# ---------------------------------------------------------------- masks, extremes, gradients


def _scramble_padding(t: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * 1e4
    garbage[..., ::3] = float("nan")
    return torch.where(mask != 0, t, garbage)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_padding_never_affects_results(name):
    old, rollout, mask = make_batch(7)
    plugin = CLASSES[name](reject_kl="k3", reject_kl_threshold=0.2)
    w1, k1, m1 = plugin(old, rollout, mask)
    w2, k2, m2 = plugin(_scramble_padding(old, mask, 1), _scramble_padding(rollout, mask, 2), mask)
    if w1 is not None:
        assert torch.equal(w1, w2)
        assert torch.all(w1[mask == 0] == 0)
    assert torch.equal(k1, k2) and torch.all(k1[mask == 0] == 0)
    assert m1 == m2 and all(math.isfinite(v) for v in m1.values())


def test_extremes_clamp_without_overflow():
    old = torch.tensor([[100.0, -100.0, 0.0], [15.0, 15.0, 15.0]])
    rollout = torch.zeros_like(old)
    mask = torch.ones_like(old)
    tok = tis_token_weights(old, rollout, mask, clip=2.0)
    assert torch.equal(tok, torch.tensor([[2.0, math.exp(-20.0), 1.0], [2.0, 2.0, 2.0]]))
    seq = tis_sequence_weights(old, rollout, mask, clip=1e12)
    assert seq[1, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)  # sum 45 clamped to 20
    _, _, metrics = TISToken()(old, rollout, mask)
    assert metrics["rollout_correction/is_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())
    weights, keep = seq_mis(old, rollout, mask)  # row 0: clamped log ratios 20 - 20 + 0 = 0
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(weights, keep)


def test_empty_mask_gives_finite_metrics():
    old, rollout, _ = make_batch(3)
    mask = torch.zeros_like(old)
    for cls in CLASSES.values():
        weights, keep, metrics = cls()(old, rollout, mask)
        assert torch.all(keep == 0)
        assert all(math.isfinite(v) for v in metrics.values())


def test_weights_are_detached_and_loss_grad_flows_only_through_the_loss():
    old, rollout, mask = make_batch(4, dtype=torch.float32)
    old.requires_grad_(True)
    rollout.requires_grad_(True)
    log_probs = (old.detach() + 0.01).requires_grad_(True)
    weights, keep, _ = TISToken()(old, rollout, mask)
    assert not weights.requires_grad and not keep.requires_grad
    per_token = -torch.exp(log_probs - old.detach()) * 0.5
    weighted, loss_mask = apply_is_weights(per_token, mask, weights, keep)
    loss = (weighted * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    assert old.grad is None and rollout.grad is None
    expected = (-torch.exp(log_probs - old.detach()) * 0.5 * weights * mask / mask.sum()).detach()
    torch.testing.assert_close(log_probs.grad, expected)


def test_float32_inputs_give_float32_weights_close_to_float64():
    old, rollout, mask = make_batch(5)
    w64 = tis_token_weights(old, rollout, mask)
    w32 = tis_token_weights(old.float(), rollout.float(), mask)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32.double(), w64, rtol=1e-5, atol=1e-6)


def test_keep_mask_keeps_the_mask_dtype():
    old, rollout, mask = make_batch(6)
    assert mis_token_mask(old, rollout, mask.bool()).dtype == torch.bool
    assert mis_token_mask(old, rollout, mask.long()).dtype == torch.long


# ---------------------------------------------------------------- plugins


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_plugins_compose_functions_and_kl_rejection(name):
    old, rollout, mask = make_batch(11, spread=0.3)
    given = {"clip": 1.5, "mask_low": 0.6, "mask_high": 1.6, "reject_kl": "k2", "reject_kl_threshold": 0.05}
    plugin = CLASSES[name](**{k: v for k, v in given.items() if k in CLASSES[name].config_keywords})
    weights, keep, _ = plugin(old, rollout, mask)
    kl_keep = kl_rejection_mask(old, rollout, mask, estimator="k2", threshold=0.05)
    geo_band = {"low": 0.6, "high": 1.6}
    expected_keep, expected_w = {
        "tis_token": (mask, tis_token_weights(old, rollout, mask, clip=1.5)),
        "tis_seq": (mask, tis_sequence_weights(old, rollout, mask, clip=1.5)),
        "mis_token": (mis_token_mask(old, rollout, mask, **geo_band), None),
        "mis_seq": (mis_sequence_mask(old, rollout, mask, **geo_band), None),
        "mis_geo": (mis_geometric_mask(old, rollout, mask, **geo_band), None),
        "seq_mis": tuple(reversed(seq_mis(old, rollout, mask, **geo_band))),
    }[name]
    expected_keep = expected_keep * kl_keep
    assert torch.equal(keep, expected_keep)
    assert 0 < kl_keep.sum() < mask.sum()
    if expected_w is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, expected_w * expected_keep, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_plugins_are_registered_and_follow_the_contract(name):
    registered = {ep.name: ep for ep in entry_points(group="lumenrl.rollout_corrections")}
    spec = registered[name].load()  # the torch-free spec in lumenrl_quant.plugin_manifest
    module, _, attr = spec.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert cls is CLASSES[name] and cls.plugin_spec is spec
    assert cls.capabilities == frozenset() and cls.probe() is None
    plugin = cls(clip=2.0, mask_low=0.5, mask_high=2.0, extreme_tau=2.0)
    assert callable(plugin)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"clip": 0.0}, "clip"),
        ({"mask_low": 2.0, "mask_high": 1.0}, "mask_low"),
        ({"extreme_tau": 0.5}, "extreme_tau"),
        ({"reject_kl": "k4"}, "reject_kl"),
    ],
)
def test_bad_keywords_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TISToken(**kwargs)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_keyword_the_mode_does_not_read_is_refused_unless_at_its_default(name):
    cls = CLASSES[name]
    unread = {"clip": 3.0, "mask_low": 0.1, "mask_high": 5.0}
    for keyword, value in unread.items():
        if keyword in cls.config_keywords:
            assert getattr(cls(**{keyword: value}), keyword) == value  # read: taken
        else:
            with pytest.raises(ValueError, match=rf"^{keyword}={value!r} has no effect on {cls.__name__}"):
                cls(**{keyword: value})
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    assert cls(**{k: defaults[k] for k in unread})  # each class's own defaults (mis_geo's band) are accepted
    with pytest.raises(ValueError, match=r"^reject_kl_threshold=0\.1 has no effect with reject_kl=None"):
        cls(reject_kl_threshold=0.1)
    assert cls(reject_kl="k1", reject_kl_threshold=0.1).reject_kl_threshold == 0.1


def test_unread_keyword_examples_name_the_argument():
    with pytest.raises(ValueError, match="clip=3.0"):
        MISToken(clip=3.0)
    with pytest.raises(ValueError, match="mask_low=0.1"):
        TISToken(mask_low=0.1)
    assert TISToken(mask_low=0.5, mask_high=2.0).clip == 2.0  # the base defaults: nothing set
    assert MISGeometric(mask_low=0.5, mask_high=2.0).mask_low == 0.5  # its own keyword, away from its 0.999


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="rollout_log_probs"):
        tis_token_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="extreme_tau"):
        rollout_correction_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), extreme_tau=0.1)
