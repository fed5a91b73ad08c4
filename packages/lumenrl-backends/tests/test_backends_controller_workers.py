"""Actor/ref/critic/reward workers driven through LocalController dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.controllers import LocalController, WorkerGroup
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.megatron import MegatronBackend
from lumenrl_backends.workers import ActorWorker, CriticWorker, RefWorker, RewardWorker, place_scores
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

P, T, V = 4, 5, 64


@pytest.fixture(scope="module")
def tiny_path(tiny_qwen3_path) -> str:
    return tiny_qwen3_path(narrow=True, vocab_size=V)


def make_backend(path: str, role: str) -> FSDP2Backend:
    return FSDP2Backend(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        role=role,
        optim=None if role == "ref" else OptimConfig(lr=1e-2),
        train=PolicyTrainConfig(micro_batch_size=2),
        num_training_steps=4,
        device=torch.device("cpu"),
    )


def make_batch(rows: int = 4) -> DataProto:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (rows, P + T), generator=g)
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, P + T, dtype=torch.long),
        "responses": ids[:, P:],
        "response_mask": torch.ones(rows, T),
        "advantages": torch.randn(rows, T, generator=g),
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 0.8})


def pg_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = (
        -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum()
        / micro.meta_info["mini_batch_tokens"]
    )
    return loss, {"actor/pg_loss": float(loss.detach())}


def test_actor_and_ref_workers_through_the_controller(tiny_path, tmp_path):
    actor, ref = ActorWorker(make_backend(tiny_path, "actor")), RefWorker(make_backend(tiny_path, "ref"))
    actors = WorkerGroup([actor], name="actor", controller=LocalController())
    refs = WorkerGroup([ref], name="ref", controller=LocalController())
    batch = make_batch()
    out = actors.call("compute_log_prob", batch, with_entropy=True)
    direct, entropy = actor.backend.compute_log_probs(batch, temperature=0.8, with_entropy=True)
    assert torch.equal(out.batch["old_log_probs"], direct) and torch.equal(out.batch["entropys"], entropy)
    assert torch.equal(refs.call("compute_ref_log_prob", batch).batch["ref_log_probs"], direct)
    batch.union(out)
    metrics = actors.call("update_actor", batch, pg_loss)  # declared dp_compute_metric
    assert {"actor/loss", "actor/grad_norm", "actor/lr", "actor/pg_loss"} <= set(metrics)
    after = actors.call("compute_log_prob", batch).batch["old_log_probs"]
    assert not torch.equal(after, direct)  # the update changed the policy
    assert actors.call("save_checkpoint", str(tmp_path / "a"), {"step": 1}) == [None]
    assert actors.call("load_checkpoint", str(tmp_path / "a")) == [{"step": 1}]
    names = dict(actors.call("named_weights")[0])
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_critic_worker_values_and_update(tiny_path):
    critic = WorkerGroup([CriticWorker(make_backend(tiny_path, "critic"))], controller=LocalController())
    batch = make_batch()
    values = critic.call("compute_values", batch).batch["values"]
    assert values.shape == (4, T) and values.dtype == torch.float32

    def value_loss(outputs, micro):
        err = (outputs["values"] - 1.0) ** 2 * micro.batch["response_mask"]
        return err.sum() / micro.meta_info["mini_batch_tokens"], {}

    first = critic.call("update_critic", batch, value_loss)["critic/loss"]
    for _ in range(3):
        last = critic.call("update_critic", batch, value_loss)["critic/loss"]
    assert last < first


def test_reward_workers_score_rows_and_place_on_last_token():
    def exact(prompts, responses, extra):
        return [1.0 if r.strip() == str(e["ground_truth"]) else 0.0 for r, e in zip(responses, extra)]

    group = WorkerGroup([RewardWorker(exact) for _ in range(3)], controller=LocalController())
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    batch = DataProto.from_dict(
        tensors={"responses": torch.zeros(5, 4, dtype=torch.long), "response_mask": mask},
        non_tensors={
            "raw_prompt": np.array(["1+1", "2+2", "3+3", "4+4", "5+5"], dtype=object),
            "response_text": np.array(["2", "5", " 6", "8", ""], dtype=object),
            "ground_truth": np.array(["2", "4", "6", "8", "10"], dtype=object),
        },
    )
    out = group.call("compute_reward", batch)
    assert out.batch["seq_scores"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    expected = torch.zeros(5, 4)
    expected[0, 2], expected[2, 3], expected[3, 1] = 1.0, 1.0, 1.0
    assert torch.equal(out.batch["token_level_scores"], expected)


def test_place_scores_on_random_masks():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 7, (16,), generator=g)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    scores = torch.randn(16, generator=g)
    placed = place_scores(scores, mask)
    for i in range(16):
        row = torch.zeros(6)
        if lengths[i] > 0:
            row[lengths[i] - 1] = scores[i]
        assert torch.equal(placed[i], row)


def test_reward_worker_needs_text_or_tokenizer():
    batch = DataProto.from_dict(
        tensors={"responses": torch.zeros(2, 3, dtype=torch.long), "response_mask": torch.ones(2, 3)}
    )
    with pytest.raises(ValueError, match="no tokenizer"):
        RewardWorker(lambda p, r, e: [0.0] * len(r)).compute_reward(batch)


def test_megatron_backend_is_honestly_unavailable():
    reason = MegatronBackend.probe()
    if reason is None:
        pytest.skip("megatron-core is installed: the backend itself is tested in test_backends_megatron.py")
    assert "egatron" in reason
    with pytest.raises(RuntimeError, match="megatron"):
        MegatronBackend(None, role="actor", optim=None, train=None, num_training_steps=1, device="cpu")
