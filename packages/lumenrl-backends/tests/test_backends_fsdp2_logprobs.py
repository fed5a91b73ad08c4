"""Fused log-prob/entropy autograd function against float64 autograd of the plain formula."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.training import logprobs
from lumenrl_backends.training.logprobs import fused_token_log_probs


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


_TRITON_CASES = """
import json, torch
from lumenrl_backends.training.logprobs import fused_token_log_probs
from test_backends_fsdp2_logprobs import case, reference, rel
# a vocabulary over two forward chunks and three backward chunks, masked (-inf) columns, two temperatures
for dtype, temperature in ((torch.float32, 1.0), (torch.float32, 0.6), (torch.bfloat16, 0.8)):
    logits, tokens, g_lp, g_ent = case(1, shape=(2, 3, 5000), dtype=dtype)
    logits[0, :, 4096:4200] = float("-inf")  # masked vocabulary: probability 0, no NaN
    logits[1, :, :4096] = float("-inf")  # a whole first chunk masked, the row's values all in the second
    tokens[0], tokens[1] = tokens[0] % 4096, 4097 + tokens[1] % 900  # targets in the unmasked columns
    view = logits.requires_grad_(True)[:, :-1]
    lp, ent = fused_token_log_probs(view, tokens, temperature, True, compile_backend="triton")
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)
    lp_only, none = fused_token_log_probs(logits[:, :-1], tokens, temperature, False, compile_backend="triton")
    (grad_lp,) = torch.autograd.grad((lp_only * g_lp).sum(), logits)
    # the float64 reference sees masked columns as -1e4: exp underflows to exactly 0, as -inf's does
    ref_in = logits.detach().double().nan_to_num(neginf=-1e4).requires_grad_(True)
    ref_lp, ref_ent = reference(ref_in[:, :-1], tokens, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), ref_in, retain_graph=True)
    (ref_grad_lp,) = torch.autograd.grad((ref_lp * g_lp).sum(), ref_in)
    print(json.dumps({"case": f"{dtype}-{temperature}", "lp": float((lp.double() - ref_lp).abs().max()),
                      "ent": float((ent.double() - ref_ent).abs().max()), "none": none is None,
                      "grad": rel(grad, ref_grad), "grad_lp": rel(grad_lp, ref_grad_lp),
                      "finite": bool(grad.isfinite().all() and lp.isfinite().all() and ent.isfinite().all()),
                      "grad_dtype": str(grad.dtype), "last_zero": bool((grad[:, -1] == 0).all())}))
"""


def test_one_pass_triton_kernels_match_float64(triton_interpreted):
    """The CUDA default of a compiled step (``logprob_backend``), in Triton's interpreter on the CPU."""
    rows = triton_interpreted({"cases": _TRITON_CASES}).json_rows("cases")
    assert len(rows) == 3
    for name, row in rows.items():
        bf16 = "bfloat16" in name  # bf16 logits: float64 reference of the same bf16 values; bf16 gradient rounding
        assert row["finite"] and row["none"] and row["last_zero"], (name, row)
        assert row["lp"] < 5e-5 and row["ent"] < 5e-5, (name, row)
        assert row["grad"] < (5e-3 if bf16 else 5e-5) and row["grad_lp"] < (5e-3 if bf16 else 5e-5), (name, row)


_TRITON_CONFIG_CASES = """
import json, torch
from lumenrl_backends.training import triton_logprobs as tk
from test_backends_fsdp2_logprobs import case, reference, rel
# launch parameters the benchmark sweeps: prefetching forward loops, multi-chunk backward programs with a ragged end
logits, tokens, g_lp, g_ent = case(2, shape=(2, 3, 5000), dtype=torch.float32)
logits[0, :, 1024:1100] = float("-inf")
tokens[0] = tokens[0] % 1024
x = logits[:, :-1]
ref_in = x.double().nan_to_num(neginf=-1e4).requires_grad_(True)
ref_lp, ref_ent = reference(ref_in, tokens, 0.7)
(ref_grad,) = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), ref_in)
for fwd, bwd in (({"prefetch": True}, {"chunks": 2}),
                 ({"block": 1024, "prefetch": True, "stages": 2, "num_warps": 4}, {"block": 1024, "chunks": 3, "stages": 2}),
                 ({"block": 2048, "stages": 3}, {"block": 4096, "chunks": 4, "num_warps": 4})):
    lse, lp, ent = tk.token_log_probs_forward(x, tokens, 0.7, True, config=fwd)
    grad = tk.token_log_probs_backward(x, tokens, lse, ent, g_lp, g_ent, 0.7, config=bwd)
    print(json.dumps({"case": json.dumps([fwd, bwd]), "lp": float((lp.double() - ref_lp).abs().max()),
                      "ent": float((ent.double() - ref_ent).abs().max()), "grad": rel(grad, ref_grad),
                      "finite": bool(grad.isfinite().all() and lp.isfinite().all() and ent.isfinite().all())}))
"""


def test_every_launch_configuration_matches_float64(triton_interpreted):
    """The forward's prefetch and pipelined loop and the backward's multi-chunk programs compute the same values."""
    rows = triton_interpreted({"configs": _TRITON_CONFIG_CASES}).json_rows("configs")
    assert len(rows) == 3
    for name, row in rows.items():
        assert row["finite"] and row["lp"] < 5e-5 and row["ent"] < 5e-5 and row["grad"] < 5e-5, (name, row)


def test_a_compiled_cuda_step_uses_the_triton_kernels():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert logprobs.logprob_backend(cpu, True) == "inductor" and logprobs.logprob_backend(cuda, "eager") == "eager"
    expected = "triton" if logprobs.triton_logprobs.available() else "inductor"
    assert logprobs.logprob_backend(cuda, True) == expected


@pytest.mark.skipif(not torch.cuda.is_available() or not logprobs.triton_logprobs.available(), reason="needs CUDA")
def test_triton_kernels_on_cuda_match_float64_at_a_real_vocabulary():
    """Qwen3's vocabulary (151936: 38 forward chunks, a ragged last one), bf16 logits of a trained model's scale."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(2, 257, 151936, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, 151936, (2, 256), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(2, 256, device="cuda", generator=g), torch.randn(2, 256, device="cuda", generator=g)
    lp, ent = fused_token_log_probs(logits[:, :-1], tokens, 0.9, True, compile_backend="triton")
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)
    ref_in = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = reference(ref_in[:, :-1], tokens, 0.9)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), ref_in)
    assert (lp.double() - ref_lp).abs().max() < 5e-5 and (ent.double() - ref_ent).abs().max() < 5e-5
    assert grad.dtype == torch.bfloat16 and rel(grad, ref_grad) < 5e-3  # bf16 rounding of the gradient
