"""FSDP2 backend on a tiny Qwen3 (1-rank gloo group, CPU, fp32) against plain HF forwards."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig, RunConfig, TrainingQuantConfig
from lumenrl_core.data_proto import DataProto

CPU = torch.device("cpu")
P, T, V = 5, 6, 96


@pytest.fixture(scope="module")
def tiny_path(tiny_qwen3_path) -> str:
    return tiny_qwen3_path(vocab_size=V)


def load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def make_batch(rows: int = 4, seed: int = 1) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, P + T), generator=g)
    attn = torch.ones(rows, P + T, dtype=torch.long)
    attn[0, :2] = 0  # left-padded prompt
    resp_mask = torch.ones(rows, T)
    resp_mask[1, 3:] = 0  # right-padded response
    attn[1, P + 3 :] = 0
    return DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "responses": ids[:, P:],
            "response_mask": resp_mask,
            "advantages": torch.randn(rows, T, generator=g),
        }
    )


def backend(path, *, role="actor", micro=8, mini=0, lr=1e-2, clip=1.0, schedule="constant", **train_kw):
    optim = (
        None if role == "ref" else OptimConfig(lr=lr, grad_clip=clip, lr_schedule=schedule, warmup_steps=2)
    )
    train = PolicyTrainConfig(micro_batch_size=micro, mini_batch_size=mini, **train_kw)
    return FSDP2Backend(load(path), role=role, optim=optim, train=train, num_training_steps=10, device=CPU)


def grads(b) -> list[torch.Tensor]:
    """Full fp32 gradients in ``model.parameters()`` order (FSDP2 DTensors or single-device masters)."""
    if b.single is not None:
        return [m.grad for m in b.single.masters]
    return [p.grad.full_tensor() for p in b.model.parameters()]


def nll_loss(outputs, micro):
    """Token-mean of -A * log p over the mini-batch (normalized by the global token count)."""
    mask = micro.batch["response_mask"]
    adv = micro.batch["advantages"]
    loss = -(adv * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {"actor/entropy": float((outputs["entropy"].detach() * mask).sum() / mask.sum())}


def reference_log_probs(model, batch, temperature):
    """float64 plain forward: log_softmax(logits / temperature) at the response tokens."""
    ref = copy.deepcopy(model).double()
    attn = batch.batch["attention_mask"]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = ref(input_ids=batch.batch["input_ids"], attention_mask=attn, position_ids=pos).logits
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1] / temperature, dim=-1)
    return logp.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_probe_and_capabilities():
    assert FSDP2Backend.probe() is None
    assert {"logprobs", "values", "checkpoint"} <= FSDP2Backend.capabilities


def test_compiled_layers_take_the_layer_inductor_options(tiny_path):
    """Inductor layers compile with LAYER_INDUCTOR_OPTIONS (mix-order reduction off); another backend gets none;
    a key this torch's Inductor lacks is dropped, not passed on (compiling would refuse it)."""
    from unittest import mock

    import torch._inductor.config as inductor_config

    from lumenrl_backends.training import modeling

    before = inductor_config.triton.mix_order_reduction
    model = load(tiny_path)
    modeling.compile_decoder_layers(model, True)
    for layer in modeling.decoder_layers(model):
        config = layer._compiled_call_impl.get_compiler_config()
        assert config["triton.mix_order_reduction"] is False
    assert inductor_config.triton.mix_order_reduction is before  # the process-wide setting is left alone
    eager = load(tiny_path)
    modeling.compile_decoder_layers(eager, "eager")
    assert modeling.decoder_layers(eager)[0]._compiled_call_impl.get_compiler_config() is None
    with mock.patch.dict(modeling.LAYER_INDUCTOR_OPTIONS, {"triton.no_such_option": 1}):
        assert modeling.layer_inductor_options() == {"triton.mix_order_reduction": False}


def test_log_probs_match_a_plain_float64_forward(tiny_path):
    batch = make_batch(5)
    be = backend(tiny_path, role="ref", micro=2)
    lp, ent = be.compute_log_probs(batch, temperature=0.7, with_entropy=True)
    ref_lp, ref_ent = reference_log_probs(load(tiny_path), batch, 0.7)
    valid = batch.batch["attention_mask"][:, P:].bool()
    assert lp.shape == ent.shape == (5, T) and lp.dtype == torch.float32
    assert (lp.double() - ref_lp)[valid].abs().max() < 2e-5
    assert (ent.double() - ref_ent)[valid].abs().max() < 2e-5
    assert be.compute_log_probs(batch)[1] is None


def test_train_step_reduces_the_loss_and_reports_metrics(tiny_path):
    be = backend(tiny_path, micro=2, mini=2)
    batch = make_batch(4)
    losses = [be.train_step(batch, nll_loss)["actor/loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses
    metrics = be.train_step(batch, nll_loss)
    assert {"actor/loss", "actor/grad_norm", "actor/lr", "actor/entropy"} <= set(metrics)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == pytest.approx(1e-2)
    assert be.scheduler.last_epoch == 7 * 2  # two mini-batches per train_step -> two optimizer steps


def test_micro_batching_gives_the_same_gradients_as_one_batch(tiny_path):
    batch = make_batch(4)
    seen = []

    def recording_loss(outputs, micro):
        seen.append((len(micro), micro.meta_info["mini_batch_tokens"], micro.meta_info["mini_batch_seqs"]))
        return nll_loss(outputs, micro)

    whole, split = backend(tiny_path, micro=4, clip=0.0), backend(tiny_path, micro=1, clip=0.0)
    m_whole = whole.train_step(batch, recording_loss)
    m_split = split.train_step(batch, recording_loss)
    tokens = float(batch.batch["response_mask"].sum())
    assert seen == [(4, tokens, 4)] + [(1, tokens, 4)] * 4
    assert m_split["actor/loss"] == pytest.approx(m_whole["actor/loss"], rel=1e-5)
    names = [name for name, _ in whole.model.named_parameters()]
    for name, ga, gb in zip(names, grads(whole), grads(split), strict=True):
        assert (ga - gb).norm() <= 1e-5 * ga.norm() + 1e-8, name


def test_gradient_checkpointing_does_not_change_gradients(tiny_path):
    batch = make_batch(4)
    plain, ckpt = backend(tiny_path, clip=0.0), backend(tiny_path, clip=0.0, gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in ckpt.model.model.layers)
    assert not any(layer.gradient_checkpointing for layer in plain.model.model.layers)
    critic = backend(tiny_path, role="critic", gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in critic.model.model.layers)
    plain.train_step(batch, nll_loss)
    ckpt.train_step(batch, nll_loss)
    for ga, gb in zip(grads(plain), grads(ckpt), strict=True):
        assert (ga - gb).norm() <= 1e-5 * ga.norm() + 1e-8


def test_checkpoint_round_trip_gives_identical_next_steps(tiny_path, tmp_path):
    batch = make_batch(4)
    a = backend(tiny_path, micro=2, mini=2, schedule="linear")
    a.train_step(batch, nll_loss)
    a.save_checkpoint(str(tmp_path / "ckpt"), extra={"dataloader_position": 7})
    after_save = torch.rand(3)
    expected = [a.train_step(batch, nll_loss) for _ in range(2)]

    b = backend(tiny_path, micro=2, mini=2, schedule="linear")
    assert b.load_checkpoint(str(tmp_path / "ckpt")) == {"dataloader_position": 7}
    assert torch.equal(torch.rand(3), after_save)  # RNG restored
    got = [b.train_step(batch, nll_loss) for _ in range(2)]
    for e, g in zip(expected, got):
        assert g["actor/loss"] == pytest.approx(e["actor/loss"], rel=1e-6, abs=1e-7)
        assert g["actor/lr"] == e["actor/lr"]
    assert sorted((tmp_path).iterdir()) == [tmp_path / "ckpt"]  # no tmp/old directories left


def test_checkpoint_overwrite_and_missing_path(tiny_path, tmp_path):
    be = backend(tiny_path)
    be.save_checkpoint(str(tmp_path / "c"))
    be.save_checkpoint(str(tmp_path / "c"), extra={"step": 2})
    assert be.load_checkpoint(str(tmp_path / "c")) == {"step": 2}
    with pytest.raises(FileNotFoundError, match="incomplete"):
        be.load_checkpoint(str(tmp_path / "nope"))


def test_named_weights_and_save_hf_round_trip(tiny_path, tmp_path):
    be = backend(tiny_path)
    be.train_step(make_batch(4), nll_loss)
    weights = dict(be.named_weights())
    reference = load(tiny_path).state_dict()
    assert set(weights) == set(reference)
    assert all(weights[k].shape == reference[k].shape for k in reference)
    be.save_hf(str(tmp_path / "hf"))
    reloaded = load(str(tmp_path / "hf")).state_dict()
    assert all(torch.equal(reloaded[k], weights[k]) for k in reference)


def test_critic_values_match_backbone_plus_head_and_train(tiny_path, tmp_path):
    critic = backend(tiny_path, role="critic", micro=2, lr=3e-3)
    batch = make_batch(4)
    values = critic.compute_values(batch)
    head = dict(critic.named_weights())
    plain = load(tiny_path).double()
    attn = batch.batch["attention_mask"]
    hidden = plain.model(
        input_ids=batch.batch["input_ids"],
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
    ).last_hidden_state
    ref = hidden @ head["value_head.weight"].double().T + head["value_head.bias"].double()
    valid = attn[:, P:].bool()
    assert (values.double() - ref[:, P - 1 : P + T - 1, 0])[valid].abs().max() < 2e-5
    target = torch.full((4, T), 0.5)

    def value_loss(outputs, micro):
        mask = micro.batch["response_mask"]
        return ((outputs["values"] - 0.5) ** 2 * mask).sum() / micro.meta_info["mini_batch_tokens"], {}

    losses = [critic.train_step(batch, value_loss)["critic/loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert (critic.compute_values(batch) - target).abs().mean() < (values - target).abs().mean()
    critic.save_hf(str(tmp_path / "critic"))
    assert (tmp_path / "critic" / "value_head.safetensors").is_file()
    with pytest.raises(RuntimeError, match="compute_values"):
        critic.compute_log_probs(batch)


def test_sft_step_lowers_cross_entropy_without_touching_the_rl_schedule(tiny_path):
    be = backend(tiny_path, micro=2)
    batch = make_batch(3)
    labels = batch.batch["input_ids"].clone()
    labels[:, :P] = -100
    batch.batch["labels"] = labels
    losses = [be.sft_step(batch, lr=1e-2)["sft/loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert be.scheduler.last_epoch == 0 and be.optimizer.state == {}


def test_from_config_builds_each_role(tiny_path):
    cfg = RunConfig()
    cfg.cluster.device = "cpu"
    cfg.dataset.train_batch_size, cfg.policy.rollout.n = 2, 4
    cfg.policy.train.mini_batch_size, cfg.policy.train.ppo_epochs = 4, 2
    actor = FSDP2Backend.from_config(cfg, role="actor", model_path=tiny_path)
    assert actor.scheduler.lr_lambdas[0].args[0].num_training_steps == cfg.num_training_steps * 4
    assert FSDP2Backend.from_config(cfg, role="ref", model_path=tiny_path).optimizer is None
    assert FSDP2Backend.from_config(cfg, role="critic", model_path=tiny_path).is_critic
    cfg.policy.parallel.pp = 2  # pipeline stages are the megatron backend's
    with pytest.raises(ValueError, match=r"policy.parallel.pp=2: the fsdp2 backend has no pipeline parallelism; allowed: 1"):
        FSDP2Backend.from_config(cfg, role="actor", model_path=tiny_path)


def test_bad_arguments_are_named(tiny_path):
    with pytest.raises(ValueError, match="role='policy'"):
        backend(tiny_path, role="policy")
    with pytest.raises(ValueError, match="mini_batch_size=3"):
        backend(tiny_path, mini=3).train_step(make_batch(4), nll_loss)
    with pytest.raises(RuntimeError, match="no optimizer"):
        backend(tiny_path, role="ref").train_step(make_batch(4), nll_loss)
    with pytest.raises(ValueError, match="mxfp4"):
        FSDP2Backend(
            load(tiny_path),
            role="actor",
            optim=OptimConfig(),
            train=PolicyTrainConfig(),
            num_training_steps=1,
            device=CPU,
            fp8=TrainingQuantConfig(precision="mxfp4"),
        )


def test_fp8_training_converts_linears_and_still_learns(tiny_path):
    fp8 = TrainingQuantConfig(precision="fp8", recipe="tensorwise", fp8_format="hybrid")
    make = lambda: FSDP2Backend(  # noqa: E731
        load(tiny_path),
        role="actor",
        optim=OptimConfig(lr=1e-2),
        train=PolicyTrainConfig(micro_batch_size=4),
        num_training_steps=10,
        device=CPU,
        fp8=fp8,
    )
    try:
        from lumenrl_quant.training import convert_to_fp8_training  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="convert_to_fp8_training"):
            make()
        return
    be = make()
    assert len(be.fp8_report.converted) == 14 and "lm_head" in be.fp8_report.skipped  # 7 linears x 2 layers
    batch = make_batch(4)
    lp, _ = be.compute_log_probs(batch)
    ref_lp, _ = reference_log_probs(load(tiny_path), batch, 1.0)
    valid = batch.batch["attention_mask"][:, P:].bool()
    err = (lp.double() - ref_lp)[valid]
    assert err.abs().mean() < 0.02 * ref_lp[valid].abs().mean()  # FP8 GEMMs: close, not exact
    losses = [be.train_step(batch, nll_loss)["actor/loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_token_log_probs_and_entropy_match_float64_on_large_logits(temperature):
    from lumenrl_backends.training.modeling import token_log_probs

    g = torch.Generator().manual_seed(11)
    logits = 30 * torch.randn(3, 7, 50, generator=g)  # large: tests the logsumexp path
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    lp, ent = token_log_probs(logits, tokens, temperature, with_entropy=True)
    ref = torch.log_softmax(logits.double() / temperature, -1)
    assert (lp.double() - ref.gather(-1, tokens[..., None])[..., 0]).abs().max() < 1e-4
    assert (ent.double() - (-(ref.exp() * ref).sum(-1))).abs().max() < 1e-4
    with pytest.raises(ValueError, match="temperature=0"):
        token_log_probs(logits, tokens, 0, with_entropy=False)


def test_set_training_switches_every_module_and_skips_a_model_already_there(monkeypatch):
    """``set_training`` puts every module in the mode (dropout included) and does not walk the modules again when
    the model is already in it."""
    from torch import nn

    from lumenrl_backends.training.modeling import set_training

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))).eval()
    set_training(model, True)
    assert all(m.training for m in model.modules())
    walks = []
    monkeypatch.setattr(nn.Module, "train", lambda self, mode=True: walks.append(mode) or self)
    set_training(model, True)
    assert walks == []  # already training: no walk
    monkeypatch.undo()
    set_training(model, False)
    assert not any(m.training for m in model.modules())
    x = torch.randn(3, 4)
    assert torch.equal(model(x), model(x))  # eval: the dropouts are off
