"""Fused log-prob/entropy autograd function against float64 autograd of the plain formula."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.training import logprobs
from lumenrl_backends.training.logprobs import fused_token_log_probs

torch.set_num_threads(2)


def reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    z = logits.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def case(seed: int, shape=(3, 7, 50), scale=6.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(shape[0], shape[1] + 1, shape[2], generator=g)).to(dtype)
    tokens = torch.randint(0, shape[2], shape[:2], generator=g)
    g_lp, g_ent = torch.randn(shape[:2], generator=g), torch.randn(shape[:2], generator=g)
    return logits, tokens, g_lp, g_ent


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("backend", [None, "eager"], ids=["chunked", "compiled-eager"])
def test_values_and_gradients_match_float64(temperature, backend, monkeypatch):
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 50)  # several chunks per row slab
    logits, tokens, g_lp, g_ent = case(0)
    view = logits.requires_grad_(True)[:, :-1]  # the non-contiguous response slice, as in training
    lp, ent = fused_token_log_probs(view, tokens, temperature, True, compile_backend=backend)
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)

    ref_in = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = reference(ref_in[:, :-1], tokens, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), ref_in)
    assert lp.dtype == torch.float32 and lp.shape == tokens.shape
    # float32 rounding of |z| ~ 25 logits (lse - sum p z cancels for peaked rows): ~1e-5 absolute
    assert (lp.double() - ref_lp).abs().max() < 5e-5 and (ent.double() - ref_ent).abs().max() < 5e-5
    assert rel(grad, ref_grad) < 5e-5
    assert (grad[:, -1] == 0).all() and grad[:, :-1].abs().sum() > 0  # the unused last position


def test_log_probs_only_and_bf16_logits():
    logits, tokens, g_lp, _ = case(1, dtype=torch.bfloat16)
    x = logits.requires_grad_(True)
    lp, ent = fused_token_log_probs(x[:, :-1], tokens, 1.0, False)
    assert ent is None
    (grad,) = torch.autograd.grad((lp * g_lp).sum(), x)
    ref_in = logits.detach().double().requires_grad_(True)
    ref_lp, _ = reference(ref_in[:, :-1], tokens, 1.0)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp).sum(), ref_in)
    assert grad.dtype == torch.bfloat16
    assert (lp.double() - ref_lp).abs().max() < 1e-4  # inputs exact in bf16; float32 math
    assert rel(grad, ref_grad) < 1e-2  # gradient rounded to bf16


def test_two_dim_logits_and_entropy_only_gradient():
    logits, tokens, _, g_ent = case(2, shape=(1, 9, 40))
    x = logits[0].clone().requires_grad_(True)  # (N, V)
    lp, ent = fused_token_log_probs(x, torch.cat([tokens[0], tokens[0, :1]]), 1.3, True)
    (grad,) = torch.autograd.grad((ent[:9] * g_ent[0]).sum(), x)
    ref_in = x.detach().double().requires_grad_(True)
    _, ref_ent = reference(ref_in, torch.cat([tokens[0], tokens[0, :1]]), 1.3)
    (ref_grad,) = torch.autograd.grad((ref_ent[:9] * g_ent[0]).sum(), ref_in)
    assert rel(grad, ref_grad) < 5e-5


def test_rejects_non_positive_temperature():
    logits, tokens, _, _ = case(3)
    with pytest.raises(ValueError, match="temperature=0"):
        fused_token_log_probs(logits[:, :-1], tokens, 0.0, False)
