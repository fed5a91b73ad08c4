"""Bitwise on-policy mode (policy.rollout.exact_logprobs): the native engine's log-probs equal the
trainer's bit for bit (torch.equal) on random tiny Qwen3 and Llama models, for batch sizes 1, 3 and
64, mixed prompt lengths and continuous batching (max_batch_size below the batch); the first
mini-batch's ratio is exactly 1 and TIS/MIS become no-ops; the operators against float64."""

from __future__ import annotations

import copy

import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.exact import exact_attention, exact_linear, exact_rms_norm, exact_token_log_probs
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_backends.trainers.update import apply_rollout_correction
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config import load_config
from lumenrl_core.config.errors import ConfigError
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

CPU = torch.device("cpu")
WORDS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc def, ghi?", "100-1=", "x", "hello world!! 42"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_dir(request, tiny_model_dir):
    return tiny_model_dir(request.param, seed=1, initializer_range=0.2)


def _prompts(tokenizer, n: int) -> DataProto:
    texts = [WORDS[i % len(WORDS)] * (1 + i % 3) for i in range(n)]  # lengths 1..48 characters
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def _trainer(model, micro: int, packing: str = "auto") -> FSDP2Backend:
    train = PolicyTrainConfig(micro_batch_size=micro, single_device="on", packing=packing)
    return FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-3), train=train, num_training_steps=2,
                        device=CPU, exact_logprobs=True)


def _rollout(model_dir, rows: int, max_batch: int, new: int, temperature: float = 1.0):
    model, tokenizer = load_model_and_tokenizer(str(model_dir), dtype="float32")
    trainer_model = copy.deepcopy(model)
    engine = NativeEngine(model, tokenizer, max_batch_size=max_batch, max_seq_len=80, exact_logprobs=True)
    out = engine.generate(_prompts(tokenizer, rows), {"temperature": temperature, "max_new_tokens": new, "seed": 5})
    return out, trainer_model


@pytest.mark.parametrize(("rows", "max_batch", "new", "micro", "packing"), [
    (1, 4, 12, 1, "auto"),
    (3, 2, 12, 2, "none"),  # continuous batching: the third row joins when a slot frees; padded trainer grid
    (64, 24, 4, 64, "auto"),  # 64 rows through 24 slots, packed training rows
])
def test_engine_log_probs_equal_training_bitwise(family_dir, rows, max_batch, new, micro, packing):
    out, trainer_model = _rollout(family_dir, rows, max_batch, new)
    log_probs, _ = _trainer(trainer_model, micro, packing).compute_log_probs(out, temperature=1.0)
    mask = out.batch["response_mask"].bool()
    assert mask.sum() >= rows  # every row generated
    assert torch.equal(log_probs[mask], out.batch["rollout_log_probs"][mask])


def test_ratio_is_one_and_tis_mis_are_no_ops(family_dir):
    out, trainer_model = _rollout(family_dir, 5, 3, 6, temperature=0.9)
    backend = _trainer(trainer_model, micro=4)
    old, _ = backend.compute_log_probs(out, temperature=0.9)
    mask = out.batch["response_mask"]
    # the update's forward (grad on, other micro-batch split) gives the same numbers: ratio exp(0) = 1
    inputs = backend._inputs(out)
    with torch.enable_grad():
        new, _ = backend._forward({k: v[:3] for k, v in inputs.items()}, 0.9, False)
    assert new.requires_grad
    assert torch.equal(torch.exp(new.detach() - old[:3])[mask[:3].bool()], torch.ones(int(mask[:3].sum())))
    batch = copy.deepcopy(out)
    batch.batch["old_log_probs"] = old
    for mode in ("tis_token", "mis_token", "tis_seq"):
        cfg = load_config(None, ["quantization.rollout_correction.enabled=true",
                                 f"quantization.rollout_correction.mode={mode}"])
        from lumenrl_core.assembly import plan_run

        correction = plan_run(cfg).build_rollout_correction()
        trial = copy.deepcopy(batch)
        apply_rollout_correction(trial, correction)
        assert torch.equal(trial.batch["response_mask"], mask)  # nothing dropped
        if "is_weights" in trial.batch:
            weights = trial.batch["is_weights"]
            assert torch.equal(weights * mask, mask.to(weights.dtype))  # every weight 1 on valid tokens


def test_operators_against_float64_and_batch_invariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g)
    w = torch.randn(80, 96, generator=g) / 10
    ref = x.double() @ w.double().t()
    out = exact_linear(x, w)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(exact_linear(x[5:6], w), out[5:6])  # a row alone = the row in a batch
    assert torch.equal(exact_linear(x.bfloat16()[:3], w.bfloat16()), exact_linear(x.bfloat16(), w.bfloat16())[:3])
    norm_w = torch.rand(96, generator=g) + 0.5
    n64 = norm_w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert (exact_rms_norm(x, norm_w, 1e-6).double() - n64).abs().max() <= 1e-5
    logits = torch.randn(9, 300, generator=g) * 3
    tokens = torch.randint(0, 300, (9,), generator=g)
    lp64 = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    assert (exact_token_log_probs(logits, tokens, 0.7).double() - lp64).abs().max() <= 1e-5
    assert torch.equal(exact_token_log_probs(logits[2:3], tokens[2:3], 0.7), exact_token_log_probs(logits, tokens, 0.7)[2:3])


def test_attention_decode_equals_causal_prefill_and_float64():
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, L, D = 2, 4, 2, 40, 16
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    pad = 7  # row 1 left-padded by 7 columns: its keys start there
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None, None].repeat(B, 1, 1, 1)
    mask[1, :, :, :pad] = False
    mask[1, 0, torch.arange(pad), torch.arange(pad)] = True  # padding queries see themselves
    full, _ = exact_attention(None, q, k, v, mask, scaling=0.25)  # (B, L, H, D)
    rep = lambda t: t.repeat_interleave(H // Hkv, 1).double()  # noqa: E731
    scores = (q.double() @ rep(k).transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    ref = (scores.softmax(-1) @ rep(v)).transpose(1, 2)
    assert (full.double() - ref).abs().max() <= 1e-5
    for t in (pad, pad + 5, L - 1):  # one query against the first t+1 cache columns (decode)
        step, _ = exact_attention(None, q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1],
                                  mask[:, :, t : t + 1, : t + 1], scaling=0.25)
        assert torch.equal(step[1], full[1, t : t + 1])
    shifted, _ = exact_attention(None, q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:], None, scaling=0.25)
    assert torch.equal(shifted[0], full[1, pad:])  # the same tokens without padding (packed/trimmed layout)


def test_config_refuses_low_precision_and_compile():
    on = "policy.rollout.exact_logprobs=true"
    assert load_config(None, [on]).policy.rollout.exact_logprobs
    for bad in ("quantization.rollout.precision=fp8", "quantization.rollout.kv_cache_dtype=fp8",
                "policy.rollout.compile=full", "quantization.training.precision=fp8", "policy.dtype=float16",
                "policy.rollout_engine=hf"):
        with pytest.raises(ConfigError, match="exact_logprobs"):
            load_config(None, [on, bad])
    with pytest.raises(ConfigError):
        load_config(None, ["policy.rollout.exact_logprobs_check=sometimes"])


def test_nonzero_difference_raises_warns_or_passes_per_check_setting():
    from types import SimpleNamespace

    from lumenrl_backends.trainers.loop import _mismatch_metrics, check_exact

    mask = torch.tensor([[1, 1, 0]])
    batch = DataProto.from_dict(tensors={"response_mask": mask, "old_log_probs": torch.tensor([[-1.0, -2.0, -9.0]]),
                                         "rollout_log_probs": torch.tensor([[-1.0, -2.5, 0.0]])})
    metrics = _mismatch_metrics(batch)
    assert metrics["actor/logprob_max_abs_diff"] == 0.5  # the padded position does not count
    rollout = lambda check, on=True: SimpleNamespace(exact_logprobs=on, exact_logprobs_check=check)  # noqa: E731
    with pytest.raises(RuntimeError, match="differ"):
        check_exact(metrics, rollout("error"), step=3)
    with pytest.warns(UserWarning, match="differ"):
        check_exact(metrics, rollout("warn"), step=3)
    check_exact(metrics, rollout("off"), step=3)
    check_exact(metrics, rollout("error", on=False), step=3)  # the default mode only reports
    check_exact({"actor/logprob_max_abs_diff": 0.0}, rollout("error"), step=3)
