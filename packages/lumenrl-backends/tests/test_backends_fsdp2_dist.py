"""FSDP2 with 2 gloo ranks (spawned CPU processes) against the same run on 1 rank.

Each rank either holds the full batch and trains on its half of every mini-batch (torchrun
path) or receives its pre-split chunk (controller dispatch path); the loss trajectory, the
log-probs and the checkpoint (reloaded on 1 rank) must match the 1-rank run.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

P, T, V, ROWS, MINI, STEPS = 4, 5, 80, 8, 4, 3


def make_batch() -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (ROWS, P + T), generator=g)
    attn = torch.ones(ROWS, P + T, dtype=torch.long)
    attn[::3, :2] = 0
    mask = (torch.rand(ROWS, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    tensors = {"input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": mask}
    tensors["advantages"] = torch.randn(ROWS, T, generator=g)
    return DataProto.from_dict(tensors=tensors)


def loss_fn(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = (
        -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum()
        / micro.meta_info["mini_batch_tokens"]
    )
    return loss, {}


def build(model_path: str, fused: bool = False) -> FSDP2Backend:
    """``fused``: fused AdamW (the CUDA setting, forced on CPU): clip and skip inside the optimizer, no host sync."""
    torch.manual_seed(0)
    adamw = torch.optim.AdamW
    with mock.patch.object(torch.optim, "AdamW", lambda *a, **k: adamw(*a, **{**k, "fused": fused or k["fused"]})):
        return FSDP2Backend(
            AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
            role="actor",
            optim=OptimConfig(lr=5e-3, lr_schedule="cosine", warmup_steps=1),
            train=PolicyTrainConfig(mini_batch_size=MINI, micro_batch_size=2),
            num_training_steps=STEPS,
            device=torch.device("cpu"),
        )


def my_shard(batch: DataProto, world: int = 2) -> DataProto:
    """What controller dispatch (dp_compute_proto) hands this rank: its chunk, marked as a shard.

    Pre-sharded, global mini-batch k is the union of every rank's k-th local slice; on 1 rank the
    same batch reordered that way gives the same mini-batches.
    """
    if torch.distributed.get_world_size() == 1:
        local = MINI // world
        order = [
            c * (ROWS // world) + k * local + j
            for k in range(ROWS // MINI)
            for c in range(world)
            for j in range(local)
        ]
        return batch[order]
    chunk = batch.chunk(world)[torch.distributed.get_rank()]
    chunk.meta_info["dispatch_dp_size"] = world
    return chunk


def run(backend: FSDP2Backend, ckpt_dir: str) -> dict:
    """3 steps: whole batch (backend slices), pre-sharded (controller path), whole batch again."""
    batch = make_batch()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    log_probs, _ = backend.compute_log_probs(batch[:5])  # 5 rows: padded to 6 over 2 ranks, unpadded
    shard = batch.chunk(world)[rank]
    if world > 1:
        shard.meta_info["dispatch_dp_size"] = world
    shard_log_probs, _ = backend.compute_log_probs(shard)  # pre-sharded: this rank's rows, not gathered
    losses = [backend.train_step(b, loss_fn)["actor/loss"] for b in (batch, my_shard(batch), batch)]
    backend.save_checkpoint(ckpt_dir)
    no_sync = backend.single is None and dist_utils.can_step_without_sync(backend.optimizer, list(
        backend.model.parameters()))
    return {"losses": losses, "log_probs": log_probs.tolist(), "shard_log_probs": shard_log_probs.tolist(),
            "no_sync": no_sync}


def _worker(rank: int, world: int, port: int, model_path: str, out_dir: str, fused: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    result = run(build(model_path, fused), os.path.join(out_dir, "ckpt2"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def model_path(tiny_qwen3_path) -> str:
    return tiny_qwen3_path(narrow=True, vocab_size=V)


@pytest.mark.parametrize("fused", [False, True], ids=["host-clip", "fused-adamw"])
def test_two_gloo_ranks_match_one_rank(fused, model_path, tmp_path, spawn_ranks):
    """``fused-adamw``: the 2-rank step clips and skips on the device (norm made whole, loss all-reduced)."""
    spawn_ranks(_worker, lambda port: (2, port, model_path, str(tmp_path), fused), 2)
    two, two_r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert two["no_sync"] is fused and two_r1["no_sync"] is fused

    single = build(model_path, fused)
    one = run(single, str(tmp_path / "ckpt1"))
    assert one["losses"][-1] < one["losses"][0]  # the trajectory actually moves
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-5)
    assert two_r1["losses"] == two["losses"]  # metrics are all-reduced: every rank reports the same
    assert torch.allclose(torch.tensor(two["log_probs"]), torch.tensor(one["log_probs"]), atol=1e-5)
    shards = torch.tensor(two["shard_log_probs"] + two_r1["shard_log_probs"])  # each rank kept its own rows
    assert torch.allclose(shards, torch.tensor(one["shard_log_probs"]), atol=1e-5)

    # the 2-rank (sharded) checkpoint reloads on 1 rank: same weights as the 1-rank run
    reloaded = build(model_path)
    reloaded.load_checkpoint(str(tmp_path / "ckpt2"))
    expected = dict(single.named_weights())
    for name, tensor in reloaded.named_weights():
        assert torch.allclose(tensor, expected[name], atol=1e-5, rtol=1e-4), name
