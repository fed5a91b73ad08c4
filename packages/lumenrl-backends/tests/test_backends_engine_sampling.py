"""The batched sampler against direct float64 references and empirical frequencies."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines.sampling import (
    SamplingParams,
    coerce_sampling,
    restrict_support,
    sample_tokens,
    uniform_noise,
)


def reference_support(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Allowed token ids for one row, computed directly in float64 (HF order: top-k then top-p)."""
    values = logits.double()
    order = sorted(range(len(values)), key=lambda i: -values[i].item())
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(values[order], dim=0)
    kept, mass = [], 0.0
    for token, p in zip(order, probs.tolist()):
        if top_p < 1.0 and kept and mass >= top_p:
            break
        kept.append(token)
        mass += p
    return set(kept)


@pytest.mark.parametrize("seed", range(5))
def test_restrict_support_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=gen) * 2.0
    top_k = torch.tensor([-1, 1, 5, 40, 7, -1])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.3, 0.8, 0.55])
    masked = restrict_support(logits, top_k, top_p)
    for row in range(6):
        allowed = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert allowed == reference_support(logits[row], int(top_k[row]), float(top_p[row]))
        assert torch.equal(masked[row][list(allowed)], logits[row][list(allowed)])


def test_log_probs_are_full_vocab_log_softmax_of_scaled_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 30, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.0, 0.7])
    tokens, log_probs = sample_tokens(
        logits, temperature=temperature, top_k=torch.tensor([3, -1, 2, -1, 1]), top_p=torch.full((5,), 0.9),
        seeds=torch.arange(5), counters=torch.zeros(5, dtype=torch.int64),
    )
    effective = torch.where(temperature > 0, temperature, torch.ones(5)).double()
    reference = torch.log_softmax(logits.double() / effective[:, None], dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert log_probs.dtype == torch.float32
    assert (log_probs.double() - reference).abs().max() < 1e-6
    assert tokens[3] == logits[3].argmax()  # temperature 0: greedy
    assert tokens[4] == logits[4].argmax()  # top_k 1: greedy


def test_sample_frequencies_match_softmax():
    """Gumbel-max over the hashed uniforms draws from softmax(logits / T) within the top-k/p set."""
    draws = 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    batch = logits.expand(draws, -1)
    temperature = torch.full((draws,), 0.8)
    tokens, _ = sample_tokens(batch, temperature=temperature, top_k=torch.full((draws,), -1),
                              top_p=torch.ones(draws), seeds=torch.arange(draws) * 7919 + 3,
                              counters=torch.full((draws,), 2), restrict=False)
    freq = torch.bincount(tokens, minlength=6).double() / draws
    expected = torch.softmax(logits.double() / 0.8, dim=0)
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((freq - expected).abs() < 5 * sigma + 1e-4).all(), (freq, expected)
    # with top-k 2 the draws follow the renormalised top-2 distribution
    tokens, _ = sample_tokens(batch, temperature=temperature, top_k=torch.full((draws,), 2),
                              top_p=torch.ones(draws), seeds=torch.arange(draws) + 10**9,
                              counters=torch.zeros(draws, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=6).double() / draws
    top2 = torch.softmax(logits[:2].double() / 0.8, dim=0)
    assert freq[2:].sum() == 0
    assert (freq[:2] - top2).abs().max() < 5 * (0.25 / draws) ** 0.5


def test_uniform_noise_is_deterministic_in_range_and_decorrelated():
    seeds, counters = torch.tensor([1, 1, 2, 2**40 + 1]), torch.tensor([0, 1, 0, 0])
    u = uniform_noise(seeds, counters, 5000)
    assert torch.equal(u, uniform_noise(seeds, counters, 5000))
    assert (u > 0).all() and (u < 1).all()
    assert (u.mean(1) - 0.5).abs().max() < 0.02  # 5000 draws: sigma ~ 0.004
    assert (u.var(1) - 1 / 12).abs().max() < 0.01
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(4)).abs().max() < 0.06  # different seed / counter / high seed bits


def test_coerce_sampling_accepts_mapping_object_and_validates():
    class Cfg:
        temperature, top_p, top_k, max_new_tokens, n = 0.5, 0.9, 4, 7, 8
        stop_token_ids, ignore_eos = (3, 4), False

    params = coerce_sampling(Cfg())
    assert params == SamplingParams(temperature=0.5, top_p=0.9, top_k=4, max_new_tokens=7, stop_token_ids=[3, 4])
    assert coerce_sampling({"temperature": 0.0, "n": 4}).temperature == 0.0
    assert coerce_sampling(None) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        coerce_sampling({"top_p": 0.0})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
