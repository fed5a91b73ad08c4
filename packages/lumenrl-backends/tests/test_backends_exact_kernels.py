"""The exact mode's Triton kernels: against float64 and decode-vs-prefill in Triton's interpreter on CPU
(float32; the interpreter's tl.dot is numpy's BLAS, so the matmul's M-invariance is a GPU test), and on
CUDA (gpu marker): bf16 M-invariance of every kernel and the engine vs trainer bitwise in bf16."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and HAS_TRITON

_CASES = """
import json, torch
from lumenrl_backends.exact import exact_attention, exact_linear, exact_rms_norm, exact_token_log_probs
from lumenrl_backends.exact.ops import _use_triton
g = torch.Generator().manual_seed(0)
res = {"triton": _use_triton(torch.zeros(1))}
x = torch.randn(20, 48, generator=g); w = torch.randn(40, 48, generator=g) / 10; bias = torch.randn(40, generator=g)
ref = x.double() @ w.double().t() + bias.double()
res["lin_err"] = float((exact_linear(x, w, bias).double() - ref).abs().max() / ref.abs().max())
x = torch.randn(5, 96, generator=g); nw = torch.rand(96, generator=g) + .5
n64 = nw.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
res["rms_err"] = float((exact_rms_norm(x, nw, 1e-6).double() - n64).abs().max())
res["rms_inv"] = bool(torch.equal(exact_rms_norm(x[1:2], nw, 1e-6), exact_rms_norm(x, nw, 1e-6)[1:2]))
logits = torch.randn(3, 700, generator=g) * 3; tok = torch.randint(0, 700, (3,), generator=g)
lp64 = torch.log_softmax(logits.double() / .7, -1).gather(-1, tok[:, None])[:, 0]
lp = exact_token_log_probs(logits, tok, .7)
res["lse_err"] = float((lp.double() - lp64).abs().max())
res["lse_inv"] = bool(torch.equal(exact_token_log_probs(logits[1:2], tok[1:2], .7), lp[1:2]))
B, H, Hkv, L, D = 2, 4, 2, 14, 16
q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
pad = 4
mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None, None].repeat(B, 1, 1, 1)
mask[1, :, :, :pad] = False; mask[1, 0, torch.arange(pad), torch.arange(pad)] = True
full, _ = exact_attention(None, q, k, v, mask, scaling=0.25)
rep = lambda t: t.repeat_interleave(H // Hkv, 1).double()
sc = (q.double() @ rep(k).transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
res["attn_err"] = float((full.double() - (sc.softmax(-1) @ rep(v)).transpose(1, 2)).abs().max())
ok = True
for t in (pad, L - 1):
    step, _ = exact_attention(None, q[:, :, t:t+1], k[:, :, :t+1], v[:, :, :t+1], mask[:, :, t:t+1, :t+1], scaling=0.25)
    ok &= bool(torch.equal(step[1], full[1, t:t+1]))
sh, _ = exact_attention(None, q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:], None, scaling=0.25)
res["attn_inv"] = ok and bool(torch.equal(sh[0], full[1, pad:]))
qg = q.clone().requires_grad_()
o, _ = exact_attention(None, qg, k, v, mask, scaling=0.25)
o.square().sum().backward()
res["attn_grad_finite"] = bool(torch.isfinite(qg.grad).all())
print(json.dumps(res))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernels_interpreted_match_float64_and_are_invariant():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CASES], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert res["triton"]  # the Triton path ran (interpreted), not the torch fallback
    assert res["lin_err"] < 1e-6 and res["rms_err"] < 1e-5 and res["lse_err"] < 1e-5 and res["attn_err"] < 1e-5, res
    assert res["rms_inv"] and res["lse_inv"] and res["attn_inv"] and res["attn_grad_finite"], res


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_kernels_are_batch_invariant_in_bf16():
    from lumenrl_backends.exact import exact_attention, exact_linear, exact_rms_norm, exact_token_log_probs

    torch.manual_seed(0)
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 4096, device="cuda", dtype=torch.bfloat16) / 64
    full = exact_linear(x, w)
    ref = x.double() @ w.double().t()
    assert float((full.double() - ref).norm() / ref.norm()) < 1e-2
    for rows in (slice(0, 1), slice(5, 8), slice(100, 164), slice(999, 1000), slice(3, 300)):
        assert torch.equal(exact_linear(x[rows], w), full[rows])
    nw = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    assert torch.equal(exact_rms_norm(x[7:8], nw, 1e-6), exact_rms_norm(x, nw, 1e-6)[7:8])
    logits = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16) * 3
    tok = torch.randint(0, 151936, (64,), device="cuda")
    assert torch.equal(exact_token_log_probs(logits[3:4], tok[3:4], 1.0), exact_token_log_probs(logits, tok, 1.0)[3:4])
    B, H, Hkv, L, D = 3, 32, 8, 300, 128
    q, k, v = (torch.randn(B, h, L, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool, device="cuda"))[None, None].repeat(B, 1, 1, 1)
    full, _ = exact_attention(None, q, k, v, mask, scaling=D**-0.5)
    for t in (0, 63, 64, 200, L - 1):
        step, _ = exact_attention(None, q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], scaling=D**-0.5)
        assert torch.equal(step, full[:, t:t + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cuda_engine_log_probs_equal_training_bitwise_bf16(family, tiny_model_dir):
    from lumenrl_backends.engines import NativeEngine
    from lumenrl_backends.models import load_model_and_tokenizer
    from lumenrl_backends.training.fsdp2 import FSDP2Backend
    from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
    from lumenrl_core.data_proto import DataProto

    path = tiny_model_dir(family, seed=2, initializer_range=0.2)
    model, tokenizer = load_model_and_tokenizer(str(path), dtype="bfloat16")
    trainer_model, _ = load_model_and_tokenizer(str(path), dtype="float32")
    engine = NativeEngine(model, tokenizer, device="cuda", max_batch_size=24, max_seq_len=96, exact_logprobs=True)
    assert engine.graphs.enabled
    texts = [("12+34=" * (1 + i % 5))[: 1 + (7 * i) % 29] for i in range(64)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    train = PolicyTrainConfig(micro_batch_size=16, single_device="on")
    backend = FSDP2Backend(copy.deepcopy(trainer_model), role="actor", optim=OptimConfig(lr=1e-3), train=train,
                           num_training_steps=2, device=torch.device("cuda"), exact_logprobs=True)
    for rows in (1, 3, 64):
        sub = DataProto.from_dict(tensors={k: v[:rows] for k, v in batch.batch.items()})
        out = engine.generate(sub, {"temperature": 1.0, "max_new_tokens": 24, "seed": rows})
        log_probs, _ = backend.compute_log_probs(out, temperature=1.0)
        mask = out.batch["response_mask"].bool()
        assert torch.equal(log_probs.cpu()[mask], out.batch["rollout_log_probs"][mask]), rows
    assert engine.graphs.error is None  # the decode steps ran as captured CUDA graphs
