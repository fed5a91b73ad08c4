"""LoRA on the policy (peft): adapters train, base frozen, merged sync, adapter-free reference, export.

CPU, tiny Qwen3 built from a transformers config; float64 references for the merge math.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

peft = pytest.importorskip("peft")

from lumenrl_backends.engines import NativeEngine  # noqa: E402
from lumenrl_backends.sync import sync_to_engine  # noqa: E402
from lumenrl_backends.training.fsdp2 import FSDP2Backend  # noqa: E402
from lumenrl_backends.training.lora import AdapterFreeReference, apply_lora, merged_tensors  # noqa: E402
from lumenrl_core.config.schema import LoraConfig, OptimConfig, PolicyTrainConfig  # noqa: E402
from lumenrl_core.data_proto import DataProto  # noqa: E402

CPU = torch.device("cpu")
P, T, V = 5, 6, 96


@pytest.fixture
def tiny_model(tiny_qwen3_lm):
    """``tiny_model(seed=0)``: the shared tiny Qwen3, untied embeddings, in eval mode."""
    return lambda seed=0: tiny_qwen3_lm(seed, vocab_size=V, tie_word_embeddings=False).eval()


def lora_cfg(rank: int = 4, **kw) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=8.0, **kw)


def randomize_adapters(model: torch.nn.Module, seed: int = 3) -> None:
    """peft initialises B = 0 (a no-op adapter); give every adapter a non-zero delta."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def make_batch(rows: int = 4, seed: int = 1) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, P + T), generator=g)
    attn = torch.ones(rows, P + T, dtype=torch.long)
    attn[0, :2] = 0
    resp_mask = torch.ones(rows, T)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": resp_mask,
        "advantages": torch.randn(rows, T, generator=g),
    })


def nll_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {}


@pytest.fixture
def lora_backend(tiny_model):
    """``lora_backend(single="auto", lr=1e-2)``: an FSDP2 backend on the tiny model with LoRA adapters."""

    def make(single: str = "auto", lr: float = 1e-2) -> FSDP2Backend:
        model = apply_lora(tiny_model(), lora_cfg())
        return FSDP2Backend(
            model, role="actor", optim=OptimConfig(lr=lr),
            train=PolicyTrainConfig(micro_batch_size=2, single_device=single), num_training_steps=10, device=CPU,
        )

    return make


def test_merged_tensors_match_float64_reference_and_peft_merge(tiny_model):
    base = tiny_model()
    reference = {n: t.double() for n, t in base.state_dict().items()}
    model = apply_lora(base, lora_cfg(target_modules=["q_proj", "down_proj"]))
    randomize_adapters(model)
    merged = dict(merged_tensors(model, model.state_dict().items()))
    assert set(merged) == set(reference)  # HF names, no adapter tensors
    sd = model.state_dict()
    for name, tensor in merged.items():
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            prefix = "base_model.model." + name[: -len(".weight")]
            a = sd[f"{prefix}.lora_A.default.weight"].double()
            b = sd[f"{prefix}.lora_B.default.weight"].double()
            expect = reference[name] + (8.0 / 4) * b @ a
            assert (tensor.double() - expect).abs().max() <= 1e-6 * expect.abs().max()
            assert not torch.equal(tensor, reference[name].float())
        else:
            assert torch.equal(tensor, reference[name].float())
    # peft's own merge gives the same weights
    unloaded = model.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.allclose(tensor, unloaded[name], atol=1e-6), name


@pytest.mark.parametrize("single", ["auto", "off"])
def test_only_adapters_train_and_reference_is_the_base(single, lora_backend):
    b = lora_backend(single)
    trainable = [p for g in b.optimizer.param_groups for p in g["params"]]
    n_adapter = sum(p.numel() for n, p in b.model.named_parameters() if ".lora_" in n)
    assert sum(p.numel() for p in trainable) == n_adapter > 0
    batch = make_batch()
    ref = AdapterFreeReference(b)
    before_ref, _ = ref.compute_log_probs(batch)
    base_before = {n: t.clone() for n, t in b.named_weights() if ".lora_" not in n}
    for _ in range(3):
        b.train_step(batch, nll_loss)
    after_policy, _ = b.compute_log_probs(batch)
    after_ref, _ = ref.compute_log_probs(batch)
    base_after = {n: t for n, t in b.named_weights() if ".lora_" not in n}
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)  # the base is frozen
    assert torch.equal(before_ref, after_ref)  # the reference is exactly the initial policy
    assert (after_policy - after_ref).abs().max() > 1e-3  # the adapters did learn something


def test_sync_sends_merged_weights_and_engine_matches_trainer(tiny_model, lora_backend):
    b = lora_backend()
    batch = make_batch()
    b.train_step(batch, nll_loss)
    engine = NativeEngine(tiny_model(seed=7), tokenizer=SimpleNamespace(eos_token_id=0, pad_token_id=0),
                          device=CPU, max_batch_size=4, max_seq_len=32)
    stats = sync_to_engine(b, engine, version=1)
    assert stats.tensors == len(tiny_model().state_dict())  # every HF tensor, no adapter tensor
    expect = dict(merged_tensors(b.model, b.model.state_dict().items()))
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, expect[name]), name


def test_export_merged_model_and_peft_adapter(tmp_path, tiny_model, lora_backend):
    from peft import PeftModel

    b = lora_backend()
    batch = make_batch()
    b.train_step(batch, nll_loss)
    want, _ = b.compute_log_probs(batch)
    b.save_hf(str(tmp_path / "final"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    assert not any("lora" in n for n in merged.state_dict())
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "final" / "adapter")
    for model in (merged, reloaded):
        plain = FSDP2Backend(model, role="ref", optim=None, train=PolicyTrainConfig(micro_batch_size=2),
                             num_training_steps=1, device=CPU)
        got, _ = plain.compute_log_probs(batch)
        assert (got - want).abs().max() < 1e-5


def test_checkpoint_holds_peft_adapter_and_resumes(tmp_path, tiny_model, lora_backend):
    from peft import PeftModel

    b = lora_backend()
    batch = make_batch()
    b.train_step(batch, nll_loss)
    b.save_checkpoint(str(tmp_path / "step_1"))
    assert (tmp_path / "step_1" / "adapter" / "adapter_config.json").is_file()
    PeftModel.from_pretrained(tiny_model(), tmp_path / "step_1" / "adapter")  # loads in peft's format
    b.train_step(batch, nll_loss)
    expect, _ = b.compute_log_probs(batch)
    fresh = lora_backend()
    fresh.load_checkpoint(str(tmp_path / "step_1"))
    fresh.train_step(batch, nll_loss)
    got, _ = fresh.compute_log_probs(batch)
    assert torch.equal(got, expect)


def test_bad_target_modules_and_config_rules(tiny_model):
    from lumenrl_core.assembly.requirements import config_violations
    from lumenrl_core.config import load_config

    with pytest.raises(ValueError, match="policy.lora.target_modules"):
        apply_lora(tiny_model(), lora_cfg(target_modules=["c_attn"]))
    cfg = load_config(None, ["policy.lora.rank=8", "quantization.training.precision=fp8"])
    assert any(v.key == "policy.lora.rank" and "FP8" in v.problem for v in config_violations(cfg))
    assert not config_violations(load_config(None, ["policy.lora.rank=8"]))
