"""Trainer -> engine weight sync: streamed in place, FP8 requantize, filesystem snapshots."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lumenrl_async import FilesystemWeightSync
from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.sync import apply_latest_snapshot, publish_snapshot, sync_to_engine, trainer_weights
from lumenrl_backends.sync.inprocess import full_view
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import PolicyTrainConfig
from lumenrl_quant import QuantizedLinear

TOKENIZER = SimpleNamespace(eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3_lm):
    """``tiny_model(seed)``: the shared tiny Qwen3 at 128 wide (whole 128x128 FP8 blocks), tied embeddings."""
    return lambda seed: tiny_qwen3_lm(seed, hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=128,
                                      tie_word_embeddings=True)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return FSDP2Backend(
        tiny_model(1),
        role="ref",
        optim=None,
        train=PolicyTrainConfig(),
        num_training_steps=1,
        device=torch.device("cpu"),
    )


def trainer_state(trainer) -> dict[str, torch.Tensor]:
    return {n: full_view(p) for n, p in trainer.model.named_parameters()}  # DTensor or plain tensor


def test_trainer_weights_streams_every_tensor_once_in_order(trainer):
    names = [n for n, _ in trainer.model.named_parameters()]
    streamed = list(trainer_weights(trainer, bucket_bytes=1))  # smallest bucket: one tensor ahead
    assert [n for n, _ in streamed] == names  # tied lm_head appears once, as embed_tokens
    state = trainer_state(trainer)
    for name, tensor in streamed:
        assert not hasattr(tensor, "full_tensor") and torch.equal(tensor, state[name])
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        next(trainer_weights(trainer, bucket_bytes=0))


def test_in_process_sync_copies_in_place(trainer, tiny_model):
    engine = NativeEngine(tiny_model(2), TOKENIZER, max_batch_size=2, max_seq_len=32)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    state = trainer_state(trainer)
    assert any(not torch.equal(p, state[n]) for n, p in engine.model.named_parameters())
    stats = sync_to_engine(trainer, engine, version=3)
    assert stats.version == 3 and engine.weight_version == 3
    assert stats.tensors == len(state) and stats.bytes_read == sum(t.numel() * 4 for t in state.values())
    for name, param in engine.model.named_parameters():
        assert param.data_ptr() == ptrs[name], name  # no reallocation
        assert torch.equal(param, state[name]), name
    assert torch.equal(engine.model.lm_head.weight, state["model.embed_tokens.weight"])  # tied


def test_sync_requantizes_fp8_rollout_linears(trainer, tiny_model):
    engine = NativeEngine(tiny_model(2), TOKENIZER, max_batch_size=2, max_seq_len=32, quant_scheme="fp8_block")
    state = trainer_state(trainer)
    name = "model.layers.1.mlp.down_proj"
    layer = engine.model.get_submodule(name)
    assert isinstance(layer, QuantizedLinear)
    before = layer.dequantized_weight()
    sync_to_engine(trainer, engine, version=1)
    after, target = layer.dequantized_weight(), state[f"{name}.weight"]
    rel = float((after - target).norm() / target.norm())
    assert rel < 0.05, rel  # e4m3 with 128x128 block scales: ~2-3% relative error
    assert float((before - target).norm() / target.norm()) > 0.5  # it really changed
    assert torch.equal(engine.model.model.norm.weight, state["model.norm.weight"])  # high-precision copy


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_filesystem_snapshot_round_trip(trainer, tmp_path, dtype, tiny_model):
    sync = FilesystemWeightSync(tmp_path / "snap")
    engine = NativeEngine(tiny_model(2), TOKENIZER, max_batch_size=2, max_seq_len=32)
    assert apply_latest_snapshot(sync, engine) is None  # nothing published yet
    publish_snapshot(trainer, sync, 5, dtype=dtype)
    assert sync.manifest()["num_tensors"] == len(list(trainer.model.named_parameters()))
    assert apply_latest_snapshot(sync, engine) == 5 and engine.weight_version == 5
    assert apply_latest_snapshot(sync, engine) is None  # already current
    for name, target in trainer_state(trainer).items():
        expected = target if dtype is None else target.to(dtype).float()
        assert torch.equal(engine.model.get_parameter(name), expected), name


def test_sync_rejects_a_non_module_source(tiny_model):
    engine = SimpleNamespace(update_weights=lambda items, version: len(list(items)))
    with pytest.raises(TypeError, match="source must be an nn.Module"):
        sync_to_engine(object(), engine, 1)
    assert sync_to_engine(copy.deepcopy(tiny_model(0)), engine, 1).tensors > 0


@pytest.mark.parametrize("flush_bytes", [1, 1 << 30])
def test_copy_weights_batches_its_copies_converts_dtype_and_flushes_by_bytes(tiny_model, monkeypatch, flush_bytes):
    """``copy_weights_`` copies in foreach batches of at most ``_FLUSH_BYTES`` incoming bytes (a tiny limit: each
    tensor lands before the next is read), converting fp32 into the bf16 engine as per-tensor ``copy_`` does."""
    from lumenrl_backends.engines import weights

    monkeypatch.setattr(weights, "_FLUSH_BYTES", flush_bytes)
    target, source = tiny_model(2).to(torch.bfloat16), tiny_model(3)
    expected = {n: p.detach().to(torch.bfloat16) for n, p in source.named_parameters()}
    streamed: list[str] = []

    def stream():
        for name, tensor in source.named_parameters():
            if flush_bytes == 1 and streamed:
                assert torch.equal(target.get_parameter(streamed[-1]), expected[streamed[-1]])
            streamed.append(name)
            yield name, tensor

    assert weights.copy_weights_(target, stream()) == len(expected)
    for name, param in target.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, expected[name]), name
    assert torch.equal(target.lm_head.weight, expected["model.embed_tokens.weight"])  # tied: one storage
