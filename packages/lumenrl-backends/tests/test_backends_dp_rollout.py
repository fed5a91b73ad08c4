"""Data-parallel rollout: shards over R engine replicas reproduce one engine's batch.

Each replica is a real native engine on its own copy of a tiny Qwen3 model; the split is the
controller's ``dp_compute_proto`` (here through the local controller; the Ray tests run the
same workers in actors). Per-row seeds make a row sample the same tokens on any replica.
"""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.controllers import LocalController
from lumenrl_backends.controllers.worker_group import WorkerGroup
from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_backends.trainers.rollout import collect_rollouts, expand_groups, generate
from lumenrl_backends.workers.rollout import GroupRollout, RankShardedRollout, RolloutWorker
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 =", "9", "abc def", "100-1=", "x", "5+5="]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 6, "top_p": 1.0, "top_k": -1}


class RecordingWorker(RolloutWorker):
    """A rollout replica that remembers which rows (uids) it generated."""

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(engine, tokenizer)
        self.seen: list[str] = []

    def generate(self, batch, sampling):
        self.seen.extend(batch.non_tensor_batch["uid"].tolist())
        return super().generate(batch, sampling)


def replica(qwen3_dir, cls=RolloutWorker):
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    return cls(NativeEngine(model, tokenizer, max_batch_size=32, max_seq_len=48), tokenizer)


def rows(tokenizer, prompts, n: int, tag: str) -> DataProto:
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return expand_groups(batch, n, group_tag=tag)


def assert_same_rollout(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert a.non_tensor_batch["uid"].tolist() == b.non_tensor_batch["uid"].tolist()
    for key in ("responses", "response_mask", "input_ids", "attention_mask"):
        assert a.batch[key].shape == b.batch[key].shape, key
        assert torch.equal(a.batch[key], b.batch[key]), key
    diff = (a.batch["rollout_log_probs"] - b.batch["rollout_log_probs"]).abs().max().item()
    assert diff <= 1e-5


def test_two_replicas_generate_disjoint_shards_and_the_one_engine_batch(qwen3_dir):
    single = replica(qwen3_dir)
    workers = [replica(qwen3_dir, RecordingWorker) for _ in range(2)]
    client = GroupRollout(WorkerGroup(workers, name="rollout", controller=LocalController()))
    batch = rows(single.tokenizer, PROMPTS, 4, "s1r0")  # 8 groups x 4 = 32 rows: 16 per replica
    one = generate(single.engine, batch[:], SAMPLING, seed=11)
    two = generate(client, batch[:], SAMPLING, seed=11)
    assert_same_rollout(one, two)
    shard0, shard1 = set(workers[0].seen), set(workers[1].seen)
    assert len(workers[0].seen) == len(workers[1].seen) == 16
    assert shard0.isdisjoint(shard1) and len(shard0 | shard1) == 8  # whole groups on one replica


def test_uneven_rows_are_padded_and_unpadded(qwen3_dir):
    single = replica(qwen3_dir)
    workers = [replica(qwen3_dir, RecordingWorker) for _ in range(3)]
    client = GroupRollout(WorkerGroup(workers, name="rollout", controller=LocalController()))
    batch = rows(single.tokenizer, PROMPTS[:5], 2, "s2r0")  # 10 rows over 3 replicas: padded to 12
    one = generate(single.engine, batch[:], SAMPLING, seed=5)
    three = generate(client, batch[:], SAMPLING, seed=5)
    assert_same_rollout(one, three)
    assert [len(w.seen) for w in workers] == [4, 4, 4]  # 2 padding rows generated, then dropped


def test_dynamic_sampling_refill_is_the_same_over_two_replicas(qwen3_dir):
    single = replica(qwen3_dir)
    client = GroupRollout(
        WorkerGroup([replica(qwen3_dir) for _ in range(2)], name="rollout", controller=LocalController())
    )
    tokenizer = single.tokenizer

    def run(engine) -> tuple[DataProto, dict]:
        batches = iter([rows(tokenizer, PROMPTS[i : i + 4], 1, "p") for i in (0, 4, 0, 4)])

        def score(batch: DataProto) -> dict:  # reward: the first response token is even (real tokens)
            first = batch.batch["responses"][:, 0]
            mask = batch.batch["response_mask"].float()
            scores = torch.zeros_like(mask)
            scores[:, 0] = (first % 2 == 0).float()
            batch.batch["token_level_scores"] = scores
            return {"reward/mean": scores[:, 0].mean().item()}

        result = collect_rollouts(
            next_prompts=lambda: next(batches)[:], engine=engine, score=score, sampling=SAMPLING, n=4,
            run_seed=3, step=1, target_groups=4, dynamic_sampling=True, max_num_gen_batches=4,
        )
        return result.batch, result.metrics

    (a, ma), (b, mb) = run(single.engine), run(client)
    assert ma == mb and ma["dapo/gen_batches"] >= 2  # a refill round happened
    assert_same_rollout(a, b)
    scores = a.batch["token_level_scores"][:, 0].reshape(-1, 4)
    assert bool(((scores.min(1).values != scores.max(1).values)).all())  # only mixed groups kept


def test_rank_sharded_rollout_gathers_every_rank_shard(qwen3_dir):
    """The torchrun form: rank r generates shard r; the gather returns all shards in rank order."""
    engines = [replica(qwen3_dir) for _ in range(2)]
    batch = rows(engines[0].tokenizer, PROMPTS[:3], 2, "s3r0")  # 6 rows: 3 per rank
    one = generate(engines[0].engine, batch[:], SAMPLING, seed=2)
    shards: dict[int, dict] = {}

    def gather_for(rank: int):
        def gather(obj):
            shards[rank] = obj
            if rank == 0:  # rank 1's shard, generated by its own replica
                clients[1].generate(batch[:], {**SAMPLING, "seed": 2})
            return [shards[0], shards[1]]
        return gather

    clients = [RankShardedRollout(e.engine, pad_token_id=e.tokenizer.pad_token_id, rank=r, world=2,
                                  gather=gather_for(r)) for r, e in enumerate(engines)]
    gathered = generate(clients[0], batch[:], SAMPLING, seed=2)
    assert_same_rollout(one, gathered)
    assert shards[1]["non_tensor"]["seed"].tolist() == [2 + 3, 2 + 4, 2 + 5]  # rows 3..5, their global seeds
