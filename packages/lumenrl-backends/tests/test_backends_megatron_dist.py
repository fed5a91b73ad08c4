"""Megatron backend on 2 gloo ranks (spawned CPU processes) against the same run on 1 rank.

Layouts: tp=2 (one replica, vocab-parallel logits) and dp=2 (two replicas, Megatron's DP rank
slices the rows). Each run: log-probs and entropies (temperature 0.7), two training steps of a
policy-gradient + entropy loss, the gathered HF weights, a checkpoint, then a third step. The
2-rank results must equal the 1-rank Megatron backend's: float32 throughout, the only difference
is the order of the sums that TP splits (row-parallel partial sums, vocab-sliced log-sum-exp) or
DP reduces (gradients), so log-probs within 1e-5 absolute, loss and grad norm within 1e-5
relative, weights after the steps within 2e-5 absolute (Adam eps 1e-3, so a step cannot amplify
gradient rounding). Before training the gathered HF weights equal the checkpoint's bit for bit;
the 2-rank checkpoint (TP slices as DTensors) reloads on 1 rank and takes the same third step.
pp / ep > 1 need CUDA in Megatron-Core 0.16: their 2-GPU counterparts are at the end.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from lumenrl_backends.plugin_manifest import megatron_missing_api as missing_api
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.skipif(missing_api() is not None, reason=str(missing_api()))
P, T, V, ROWS, MINI = 4, 5, 80, 8, 4


def make_batch() -> DataProto:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (ROWS, P + T), generator=g)
    attn = torch.ones(ROWS, P + T, dtype=torch.long)
    attn[::3, :2] = 0  # left padding
    mask = (torch.rand(ROWS, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    tensors = {"input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": mask,
               "advantages": torch.randn(ROWS, T, generator=g)}
    batch = DataProto.from_dict(tensors=tensors)
    batch.meta_info["temperature"] = 0.7
    return batch


def loss_fn(outputs, micro):
    mask, tokens = micro.batch["response_mask"], micro.meta_info["mini_batch_tokens"]
    pg = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / tokens
    return pg - 0.01 * (outputs["entropy"] * mask).sum() / tokens, {"actor/entropy": (outputs["entropy"] * mask).sum()}


def build(model_path: str, tp: int = 1, pp: int = 1, ep: int = 1, device: str = "cpu"):
    from lumenrl_backends.training.megatron import MegatronBackend

    return MegatronBackend(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        role="actor",
        optim=OptimConfig(lr=1e-2, eps=1e-3, lr_schedule="cosine", warmup_steps=1),
        train=PolicyTrainConfig(mini_batch_size=MINI, micro_batch_size=2),
        num_training_steps=3,
        device=torch.device(device),
        parallel=(tp, pp, ep),
    )


def run(backend, model_path: str, ckpt_dir: str) -> dict:
    batch = make_batch().to(backend.device)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    exact = all(torch.equal(t.cpu(), hf[n]) for n, t in backend.named_weights())
    log_probs, entropy = backend.compute_log_probs(batch[:5], temperature=0.7, with_entropy=True)  # 5 rows: padded
    steps = [backend.train_step(batch, loss_fn) for _ in range(2)]
    trained = {n: t.cpu() for n, t in backend.named_weights()}
    backend.save_checkpoint(ckpt_dir, extra={"step": 2})
    third = backend.train_step(batch, loss_fn)
    return {"exact": exact, "log_probs": log_probs.cpu().tolist(), "entropy": entropy.cpu().tolist(),
            "steps": [[m["actor/loss"], m["actor/grad_norm"], m["actor/entropy"]] for m in steps + [third]],
            "trained": trained, "after": {n: t.cpu() for n, t in backend.named_weights()}}


def _worker(rank: int, world: int, port: int, model_path: str, out_dir: str, sizes: tuple, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    result = run(build(model_path, *sizes, device=device), model_path, os.path.join(out_dir, "ckpt"))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(request, monkeypatch, tmp_path, model_path: str, sizes: tuple, device: str = "cpu") -> list[dict]:
    # Spawned ranks unpickle _worker by this module's importlib-mode name: the repo root must be on sys.path
    monkeypatch.syspath_prepend(str(request.config.rootpath))
    mp.spawn(_worker, args=(2, _free_port(), model_path, str(tmp_path), sizes, device), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def model_path(tiny_qwen3_path) -> str:
    return tiny_qwen3_path(vocab_size=V)  # Qwen3: 4 heads, 2 KV heads (q/k norms reduced over TP)


@pytest.fixture(scope="module")
def one_rank(model_path, tmp_path_factory) -> dict:
    return run(build(model_path), model_path, str(tmp_path_factory.mktemp("one") / "ckpt"))


def _assert_matches(two: list[dict], one: dict) -> None:
    for result in two:
        assert result["exact"]  # gathered HF weights before training: bit-exact
        assert torch.allclose(torch.tensor(result["log_probs"]), torch.tensor(one["log_probs"]), atol=1e-5)
        assert torch.allclose(torch.tensor(result["entropy"]), torch.tensor(one["entropy"]), atol=1e-5)
        assert sum(result["steps"], []) == pytest.approx(sum(one["steps"], []), rel=1e-5, abs=1e-6)
        for name, tensor in one["after"].items():
            assert (result["after"][name] - tensor).abs().max() < 2e-5, name
    assert one["steps"][-1][0] != one["steps"][0][0]  # the trajectory moves


def _assert_reloads_on_one_rank(two: list[dict], model_path: str, ckpt: str) -> None:
    single = build(model_path)
    assert single.load_checkpoint(ckpt)["step"] == 2
    assert all(torch.equal(t, two[0]["trained"][n]) for n, t in single.named_weights())
    third = single.train_step(make_batch(), loss_fn)
    assert [third["actor/loss"], third["actor/grad_norm"]] == pytest.approx(two[0]["steps"][2][:2], rel=1e-5)
    for name, tensor in single.named_weights():
        assert (two[0]["after"][name] - tensor).abs().max() < 2e-5, name


def test_tensor_parallel_two_ranks_match_one_rank(model_path, one_rank, tmp_path, request, monkeypatch):
    two = _spawn(request, monkeypatch, tmp_path, model_path, (2, 1, 1))
    _assert_matches(two, one_rank)
    _assert_reloads_on_one_rank(two, model_path, str(tmp_path / "ckpt"))


def test_data_parallel_two_ranks_match_one_rank(model_path, one_rank, tmp_path, request, monkeypatch):
    two = _spawn(request, monkeypatch, tmp_path, model_path, (1, 1, 1))
    _assert_matches(two, one_rank)
