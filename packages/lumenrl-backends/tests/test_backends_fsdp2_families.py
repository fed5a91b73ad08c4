"""Every supported family's tiny config trains under FSDP2: log-probs match a plain forward and a
train_step moves the weights with a finite gradient norm (dense and MoE, incl. MLA attention)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.models import FAMILIES
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

P, T = 4, 5


def make_batch(vocab: int) -> DataProto:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (3, P + T), generator=g)
    attn = torch.ones(3, P + T, dtype=torch.long)
    attn[0, :2] = 0
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "responses": ids[:, P:],
        "response_mask": torch.ones(3, T),
    }
    tensors["advantages"] = torch.randn(3, T, generator=g)
    return DataProto.from_dict(tensors=tensors)


def pg_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = (
        -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum()
        / micro.meta_info["mini_batch_tokens"]
    )
    return loss, {}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_log_probs_and_train_step(family, tiny_model_dir):
    path = tiny_model_dir(family)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    backend = FSDP2Backend(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        role="actor",
        optim=OptimConfig(lr=1e-2),
        train=PolicyTrainConfig(micro_batch_size=2),
        num_training_steps=2,
        device=torch.device("cpu"),
    )
    batch = make_batch(plain.config.vocab_size)
    log_probs, _ = backend.compute_log_probs(batch)
    attn = batch.batch["attention_mask"]
    with torch.no_grad():
        logits = plain(
            input_ids=batch.batch["input_ids"],
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        ).logits
    ref = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(
        -1, batch.batch["responses"][..., None]
    )[..., 0]
    assert (log_probs - ref).abs().max() < 1e-4
    before = {k: v.clone() for k, v in backend.named_weights()}
    metrics = backend.train_step(batch, pg_loss)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
    moved = [k for k, v in backend.named_weights() if not torch.equal(v, before[k])]
    assert "lm_head.weight" in moved and any(".layers.1." in k for k in moved)
