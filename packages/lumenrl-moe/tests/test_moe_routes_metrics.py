"""Route arrays and R3 metrics against float64 / loop references on fresh random data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lumenrl_moe import (
    extreme_token_fraction,
    extreme_token_fraction_from_log_probs,
    pad_routes,
    route_flip_fraction,
    train_infer_kl,
    validate_routes,
)


def random_routes(gen: torch.Generator, tokens: int, layers: int, k: int, experts: int) -> torch.Tensor:
    scores = torch.rand(tokens, layers, experts, generator=gen)
    return scores.topk(k, dim=-1).indices  # (tokens, L, k), distinct per row


def test_validate_routes_accepts_valid_and_padded():
    gen = torch.Generator().manual_seed(0)
    routes = random_routes(gen, 6, 3, 2, 8)
    validate_routes(routes, num_experts=8, num_tokens=6, num_layers=3, top_k=2)
    padded = pad_routes(routes, 10)
    assert padded.shape == (10, 3, 2) and torch.equal(padded[:6], routes)
    assert padded[9].tolist() == [[0, 1]] * 3
    validate_routes(padded, num_experts=8, num_tokens=10)
    validate_routes(pad_routes(routes.unsqueeze(0), 7), num_tokens=7)  # (B, S, L, k)


@pytest.mark.parametrize(
    ("routes", "kwargs", "match"),
    [
        (torch.zeros(4, 2, 2), {}, "expected an integer dtype"),
        (torch.tensor([[[0, 1]], [[2, 2]]]), {}, r"repeat an expert within a row at index \[1, 0\] \(row \[2, 2\]\)"),
        (torch.tensor([[[0, 8]]]), {"num_experts": 8}, r"expert ids in \[0, 8\]; allowed: \[0, 8\)"),
        (torch.tensor([[[-1, 2]]]), {}, "allowed: >= 0"),
        (torch.tensor([[[0, 1]]]), {"num_tokens": 3}, "num_tokens=1, expected 3"),
        (torch.tensor([[[0, 1]]]), {"top_k": 4}, "top_k=2, expected 4"),
        (torch.tensor([[0, 1]]), {}, "expected \\(..., tokens, L_moe, k\\)"),
    ],
)
def test_validate_routes_rejects(routes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_routes(routes, **kwargs)


def test_route_flip_fraction_matches_loop_reference():
    gen = torch.Generator().manual_seed(1)
    a = random_routes(gen, 40, 3, 2, 6)
    b = a.clone()
    flip = torch.rand(40, 3, generator=gen) < 0.2
    b[flip] = random_routes(gen, 40, 3, 2, 6)[flip]
    b = b.flip(-1)  # order within a row must not matter
    sets_differ = [[set(a[t, j].tolist()) != set(b[t, j].tolist()) for j in range(3)] for t in range(40)]
    ref_token = sum(any(row) for row in sets_differ) / 40
    ref_layer = sum(sum(row) for row in sets_differ) / 120
    assert 0 < ref_token < 1
    assert route_flip_fraction(a, b) == pytest.approx(ref_token, abs=1e-12)
    assert route_flip_fraction(a, b, per_layer=True) == pytest.approx(ref_layer, abs=1e-12)
    mask = torch.zeros(40)
    mask[:10] = 1
    assert route_flip_fraction(a, b, mask) == pytest.approx(sum(any(r) for r in sets_differ[:10]) / 10, abs=1e-12)
    assert route_flip_fraction(a, a) == 0.0
    with pytest.raises(ValueError, match="routes_a.shape"):
        route_flip_fraction(a, b[:5])


def test_extreme_token_fraction_against_float64_reference():
    gen = torch.Generator().manual_seed(2)
    p_infer = torch.rand(8, 32, generator=gen) * 0.98 + 0.01
    p_train = (p_infer * torch.exp(torch.randn(8, 32, generator=gen) * 0.8)).clamp(1e-4, 1.0)
    mask = (torch.rand(8, 32, generator=gen) > 0.3).float()
    pt, pi, m = p_train.double().numpy(), p_infer.double().numpy(), mask.double().numpy()
    for tau in (1.5, 2.0, 4.0):
        extreme = np.maximum(pt / pi, pi / pt) > tau
        ref = float((extreme * m).sum() / m.sum())
        assert 0 < ref < 1
        assert extreme_token_fraction(p_train, p_infer, tau, mask) == pytest.approx(ref, abs=1e-12)
        assert extreme_token_fraction_from_log_probs(p_train.log(), p_infer.log(), tau, mask) == pytest.approx(ref, abs=1e-6)
    with pytest.raises(ValueError, match="tau=1.0"):
        extreme_token_fraction(p_train, p_infer, 1.0)


def test_train_infer_kl_formulas_float64():
    gen = torch.Generator().manual_seed(3)
    logp_infer = -torch.rand(4, 16, generator=gen) * 3
    logp_train = logp_infer + torch.randn(4, 16, generator=gen) * 0.3
    mask = (torch.rand(4, 16, generator=gen) > 0.25).float()
    d = (logp_train.double() - logp_infer.double()).numpy()
    m = mask.double().numpy()
    k1 = float((-d * m).sum() / m.sum())
    k3 = float(((np.exp(d) - 1 - d) * m).sum() / m.sum())
    assert train_infer_kl(logp_train, logp_infer, mask, estimator="k1") == pytest.approx(k1, rel=1e-12)
    assert train_infer_kl(logp_train, logp_infer, mask) == pytest.approx(k3, rel=1e-12)
    assert train_infer_kl(logp_train, logp_infer, mask) > 0
    with pytest.raises(ValueError, match="estimator='k2'"):
        train_infer_kl(logp_train, logp_infer, estimator="k2")


def test_train_infer_kl_estimates_exact_kl_from_samples():
    """Tokens sampled from the inference policy: k1 and k3 are unbiased for KL(infer || train)."""
    gen = torch.Generator().manual_seed(4)
    vocab, n = 50, 40_000
    logits_infer = torch.randn(vocab, generator=gen, dtype=torch.float64)
    logits_train = logits_infer + 0.4 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    lp_i, lp_t = logits_infer.log_softmax(-1), logits_train.log_softmax(-1)
    exact = float((lp_i.exp() * (lp_i - lp_t)).sum())
    tokens = torch.multinomial(lp_i.exp(), n, replacement=True, generator=gen)
    sample_t, sample_i = lp_t[tokens].float(), lp_i[tokens].float()
    for estimator, per_token in (("k1", sample_i - sample_t), ("k3", torch.expm1(sample_t - sample_i) - (sample_t - sample_i))):
        stderr = float(per_token.double().std()) / math.sqrt(n)
        estimate = train_infer_kl(sample_t, sample_i, estimator=estimator)
        assert abs(estimate - exact) < 5 * stderr, (estimator, estimate, exact, stderr)
