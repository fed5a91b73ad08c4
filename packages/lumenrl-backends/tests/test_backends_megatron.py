"""Megatron-Core backend: exact HF<->Megatron round trip per family, log-probs and one train_step
equal to the FSDP2 backend on the same weights (fp32, CPU, 1-rank gloo). Skipped when
megatron-core is not installed (``pip install 'lumenrl-backends[megatron]'``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.plugin_manifest import megatron_missing_api as missing_api
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.skipif(missing_api() is not None, reason=str(missing_api()))
FAMILIES = ("llama", "qwen3", "qwen3_moe")
P, T = 4, 5


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tiny_model_dir):
    return request.param, tiny_model_dir(request.param)


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _backend(cls, path, **kw):
    # Adam eps 1e-3: a first Adam step maps g -> lr*g/(|g|+eps); with eps=1e-8 it would amplify fp
    # rounding in near-zero gradients to ~lr, so the weight comparison would test rounding, not math
    return cls(
        _hf(path),
        role="actor",
        optim=OptimConfig(lr=1e-2, eps=1e-3),
        train=PolicyTrainConfig(micro_batch_size=2),
        num_training_steps=2,
        device=torch.device("cpu"),
        **kw,
    )


def _batch(vocab: int, seed: int) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, P + T), generator=g)
    attn = torch.ones(4, P + T, dtype=torch.long)
    attn[0, :2] = 0  # left padding
    attn[3, :3] = 0
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "responses": ids[:, P:],
        "response_mask": torch.ones(4, T),
        "advantages": torch.randn(4, T, generator=g),
    }
    return DataProto.from_dict(tensors=tensors)


def pg_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    adv = micro.batch["advantages"]
    loss = -(adv * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {"actor/entropy": (outputs["entropy"] * mask).sum() / mask.sum()}


def test_round_trip_is_exact(tiny):
    from lumenrl_backends.training.megatron import MegatronBackend

    _, path = tiny
    hf = _hf(path).state_dict()
    backend = MegatronBackend(
        _hf(path),
        role="ref",
        optim=None,
        train=PolicyTrainConfig(),
        num_training_steps=1,
        device=torch.device("cpu"),
    )
    back = dict(backend.named_weights())
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_log_probs_and_train_step_match_fsdp2(tiny):
    from lumenrl_backends.training.megatron import MegatronBackend

    _, path = tiny
    ref = _backend(FSDP2Backend, path)
    meg = _backend(MegatronBackend, path)
    batch = _batch(ref.hf_config.vocab_size, seed=int(torch.randint(0, 10**6, ())))
    for temperature in (1.0, 0.7):
        lp_ref, ent_ref = ref.compute_log_probs(batch, temperature=temperature, with_entropy=True)
        lp_meg, ent_meg = meg.compute_log_probs(batch, temperature=temperature, with_entropy=True)
        valid = batch.batch["response_mask"].bool()
        assert (lp_ref - lp_meg)[valid].abs().max() < 1e-4
        assert (ent_ref - ent_meg)[valid].abs().max() < 1e-4
    m_ref, m_meg = ref.train_step(batch, pg_loss), meg.train_step(batch, pg_loss)
    assert abs(m_ref["actor/loss"] - m_meg["actor/loss"]) < 1e-5
    assert abs(m_ref["actor/grad_norm"] - m_meg["actor/grad_norm"]) < 1e-4 * max(
        1.0, m_ref["actor/grad_norm"]
    )
    after = dict(meg.named_weights())
    for name, tensor in ref.named_weights():
        assert (after[name] - tensor).abs().max() < 1e-5, name
    start = _hf(path).state_dict()
    assert any(not torch.equal(after[k], start[k]) for k in start)  # the step moved the weights


def test_checkpoint_and_save_hf(tmp_path, tiny_model_dir):
    from lumenrl_backends.training.megatron import MegatronBackend

    path = tiny_model_dir("qwen3")  # one family: the path is family-independent
    meg = _backend(MegatronBackend, path)
    batch = _batch(meg.hf_config.vocab_size, seed=3)
    meg.train_step(batch, pg_loss)
    meg.save_checkpoint(str(tmp_path / "ckpt"), extra={"step": 1})
    meg.save_hf(str(tmp_path / "hf"))
    saved = _hf(tmp_path / "hf").state_dict()
    trained = dict(meg.named_weights())
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
    fresh = _backend(MegatronBackend, path)
    assert fresh.load_checkpoint(str(tmp_path / "ckpt"))["step"] == 1
    assert all(torch.equal(v, trained[k]) for k, v in fresh.named_weights())


def test_parallel_sizes_the_model_or_device_cannot_run_are_refused(tiny_model_dir):
    from lumenrl_backends.training.megatron import MegatronBackend

    def build(family, sizes, **overrides):
        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family, **overrides), dtype=torch.float32)
        return MegatronBackend(hf, role="ref", optim=None, train=PolicyTrainConfig(), num_training_steps=1,
                               device=torch.device("cpu"), parallel=sizes)

    with pytest.raises(ValueError, match=r"^policy.parallel.pp=2 on cpu: Megatron-Core needs CUDA here \(.*"
                                         r"schedules.py.*\); allowed on CPU: 1$"):
        build("qwen3", (1, 2, 1))
    with pytest.raises(ValueError, match=r"^moe.expert_parallel_size=2 on cpu: .*_gather_along_first_dim"):
        build("qwen3_moe", (1, 1, 2))
    with pytest.raises(ValueError, match=r"^moe.expert_parallel_size=2: llama has no experts; allowed: 1$"):
        build("llama", (1, 1, 2))
    with pytest.raises(ValueError, match=r"^policy.parallel.tp=2 with the MoE model qwen3_moe: .*allowed: 1"):
        build("qwen3_moe", (2, 1, 1))
    with pytest.raises(ValueError, match=r"^policy.parallel.tp=2 does not divide vocab_size=57 of qwen3$"):
        build("qwen3", (2, 1, 1))
    with pytest.raises(ValueError, match=r"^policy.parallel.tp=2 \* pp=1 = 2 must divide the world size 1$"):
        build("qwen3", (2, 1, 1), vocab_size=96)


def test_from_config_reads_every_parallel_key(tiny_model_dir):
    from lumenrl_backends.training.megatron.backend import _parallel_sizes
    from lumenrl_core.config.schema import RunConfig

    cfg = RunConfig()
    cfg.policy.parallel.tp, cfg.policy.parallel.pp, cfg.moe.expert_parallel_size = 2, 4, 8
    assert _parallel_sizes(cfg) == (2, 4, 8)
    cfg.policy.parallel.cp = 2
    with pytest.raises(ValueError, match=r"^policy.parallel.cp=2: the megatron backend has no context parallelism; "
                                         r"allowed: 1$"):
        _parallel_sizes(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_log_probs_and_train_step_match_fsdp2_on_gpu(tiny_model_dir):
    from lumenrl_backends.training.megatron import MegatronBackend

    path = tiny_model_dir("qwen3")
    kw = dict(role="actor", optim=OptimConfig(lr=1e-3), num_training_steps=2, device=torch.device("cuda"))
    ref = FSDP2Backend(_hf(path), train=PolicyTrainConfig(micro_batch_size=2, single_device="on"), **kw)
    meg = MegatronBackend(_hf(path), train=PolicyTrainConfig(micro_batch_size=2), **kw)
    batch = _batch(ref.hf_config.vocab_size, seed=5).to("cuda")
    lp_ref, _ = ref.compute_log_probs(batch)
    lp_meg, _ = meg.compute_log_probs(batch)
    assert (lp_ref - lp_meg).abs().max() < 0.1  # both bf16 compute: rounding differs, math does not
    m_ref, m_meg = ref.train_step(batch, pg_loss), meg.train_step(batch, pg_loss)
    assert abs(m_ref["actor/loss"] - m_meg["actor/loss"]) < 0.05 * max(1.0, abs(m_ref["actor/loss"]))



@pytest.mark.parametrize(("config", "override"), [
    ("grpo_dense_bf16", "policy.train.compile_layers=true"), ("grpo_dense_bf16", "policy.train.gradient_checkpointing=true"),
    ("grpo_dense_bf16", "policy.train.single_device=on"), ("grpo_dense_bf16", "policy.train.group_projections=on"),
    ("grpo_dense_bf16", "policy.rollout.exact_logprobs=true"),
    ("ppo_dense_bf16", "critic.enabled=true")])
def test_keys_megatron_does_not_read_are_refused_at_assembly(config, override):
    """The shipped manifest: keys the Megatron backend would skip are refused by assembly, before any model
    loads; the FSDP2 backend declares them."""
    from pathlib import Path

    from lumenrl_core.assembly import AssemblyError, plan_run
    from lumenrl_core.config import load_config

    path = str(Path(__file__).resolve().parents[3] / "configs" / f"{config}.yaml")
    with pytest.raises(AssemblyError, match=f"training backend lacks capability .* required by {override.split('=')[0]}="):
        plan_run(load_config(path, [override, "policy.training_backend=megatron"]))
    assert plan_run(load_config(path, [override])).training_backend_cls.__name__ == "FSDP2Backend"
