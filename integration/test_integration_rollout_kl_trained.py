"""The trained-model rollout KL pipeline (benchmarks/quant/bench_rollout_kl_trained.py) on a tiny model.

Not a benchmark: a few dozen training steps on the script's synthetic language, a save_pretrained /
from_pretrained round trip, then the bf16 and fp8_row native engines against the bf16 trainer. The
bf16 engine runs the trainer's own weights, so its KLs must be ~0; FP8's must be finite and > 0.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: one thread is faster than two on a shared CPU
    spec = importlib.util.spec_from_file_location(
        "bench_rollout_kl_trained", ROOT / "benchmarks" / "quant" / "bench_rollout_kl_trained.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    torch.set_num_threads(threads)


def test_synthetic_language_probabilities_are_exact(bench):
    lang = bench.SyntheticLanguage(vocab=64, seed=3)
    ids, probs = lang.sample(8, 40, seed=5, with_probs=True)
    assert ids.min() >= 2 and ids.max() < 64  # pad / eos never emitted
    torch.testing.assert_close(probs.sum(-1), torch.ones(8, 39, dtype=torch.float64))
    taken = probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (taken > 0).all()  # every sampled token had positive probability under p_true
    assert ((probs > 0).sum(-1) <= 4).all()  # sparse: the copy target is one of the K = 4 successors
    with pytest.raises(ValueError, match="p_copy"):
        bench.SyntheticLanguage(vocab=64, p_copy=1.5)


def test_trained_pipeline_bf16_zero_fp8_positive(bench, tmp_path):
    torch.manual_seed(0)
    lang = bench.SyntheticLanguage(vocab=TINY["vocab_size"], seed=0)
    model, log = bench.train(lang, steps=30, batch=8, seq=48, lr=3e-3, device="cpu", dims=TINY, log_every=0)
    assert log["final_train_loss"] < log["first_train_loss"] - 0.3  # it learns
    model.save_pretrained(tmp_path)
    trained = bench.load_bf16(tmp_path, "cpu")
    quality = bench.model_quality(trained, lang, batch=4, seq=48)
    assert quality["model_entropy"] < quality["uniform_entropy"]
    rows = bench.run_all(trained, lang, ["bf16", "fp8_row"], prompts=4, prompt_len=16, new=16,
                         device="cpu", label="tiny")
    by = {r["engine"]: r for r in rows}
    assert "error" not in by["bf16"] and "error" not in by["fp8_row"], rows
    for key in ("kl_exact_before", "kl_exact_after_tis"):
        assert abs(by["bf16"][key]) < 1e-3, (key, by["bf16"][key])
    before, after = by["fp8_row"]["kl_exact_before"], by["fp8_row"]["kl_exact_after_tis"]
    assert math.isfinite(before) and before > 0, before  # FP8 weights: a real mismatch
    # TIS removes most of it: the exact KL after TIS lies within 1e-6 of 0 (float32 summation error,
    # either sign; it is exactly 0 wherever p_train <= 2 p_roll) and never above the KL before
    assert math.isfinite(after) and -1e-6 <= after <= max(before, 1e-6), (before, after)
    assert abs(by["bf16"]["kl_k3_sampled"]) < 1e-3


def test_bf16_training_on_a_smaller_language_vocab(bench):
    """The 8B recipe on a tiny model: bf16 weights and AdamW states, a language that uses only the first
    64 of the model's 256 ids; the model learns to move its mass onto the language's ids."""
    torch.manual_seed(0)
    lang = bench.SyntheticLanguage(vocab=64, seed=1)
    untrained = bench.random_bf16("cpu", dims=TINY)
    before = bench.model_quality(untrained, lang, batch=4, seq=48)
    model, log = bench.train(lang, steps=40, batch=8, seq=48, lr=3e-3, device="cpu", dims=TINY, log_every=0,
                             dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16 and log["dtype"] == "bfloat16"
    assert log["final_train_loss"] < log["first_train_loss"] - 1.0, log
    after = bench.model_quality(model, lang, batch=4, seq=48)
    assert before["mass_outside_language"] > 0.6  # 192 of 256 ids are outside: ~3/4 of a near-uniform model
    assert after["mass_outside_language"] < 0.1, after
    assert after["kl_true_model"] < before["kl_true_model"] - 1.0, (before, after)


def test_stochastic_rounding_is_unbiased_and_brackets(bench):
    torch.manual_seed(1)
    x = torch.randn(4096, dtype=torch.float32) * 0.05
    down = x.to(torch.bfloat16)  # round to nearest: one neighbour
    rounds = torch.stack([bench.stochastic_round_bf16(x).float() for _ in range(400)])
    lo = torch.minimum(rounds.min(0).values, x)
    hi = torch.maximum(rounds.max(0).values, x)
    ulp = (down.float().abs() * 2.0 ** -7).clamp_min(1e-12)
    assert ((hi - lo) <= 1.01 * ulp).all()  # every result is one of the two bf16 neighbours of x
    bias = (rounds.double().mean(0) - x.double()).abs() / ulp.double()
    assert bias.mean() < 0.02 and bias.max() < 0.25, (bias.mean(), bias.max())  # round-to-nearest: mean ~0.25


def test_adamw_bf16_tracks_float32_adamw(bench):
    """Updates below half a bf16 ulp (lr 1e-3 on weights ~1.4, half an ulp there is 3.9e-3): torch's AdamW
    on bf16 weights (round to nearest) never moves them; AdamWBF16 follows float32 AdamW to the optimum."""
    torch.manual_seed(2)
    target = torch.randn(64, 32)
    inputs = torch.randn(256, 64)
    start = (1.4 + 0.05 * torch.randn(32)).to(torch.bfloat16)
    ref, w, nearest = (torch.nn.Parameter(start.clone().to(dtype)) for dtype in
                       (torch.float32, torch.bfloat16, torch.bfloat16))
    opts = [(ref, torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)),
            (w, bench.AdamWBF16([w], lr=1e-3, betas=(0.9, 0.95))),
            (nearest, torch.optim.AdamW([nearest], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0))]
    for _ in range(500):
        for param, opt in opts:
            loss = ((inputs @ (target * param.float()[None]) - inputs @ target) ** 2).mean()  # optimum: param = 1
            opt.zero_grad()
            loss.backward()
            opt.step()
    travel = (ref.detach().double() - start.double()).abs()
    assert travel.mean() > 0.3, travel.mean()  # float32 AdamW went most of the way to 1 (~0.4)
    assert torch.equal(nearest.detach(), start)  # round to nearest: stuck at the start
    err = (w.detach().double() - ref.detach().double()).abs()
    assert err.mean() < 0.05 * travel.mean(), (err.mean(), travel.mean())
