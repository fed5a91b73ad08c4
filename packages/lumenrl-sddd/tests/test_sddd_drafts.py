"""Torch-level pieces of lumenrl-sddd: layer choice, draft vocabulary, Eagle3 / DFlash losses and
inference contracts, the TCP and MORI transfer engines, Eagle3 export / reload."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lumenrl_sddd.capture import dflash_layer_ids, eagle3_layer_ids
from lumenrl_sddd.dflash import DFlashConfig, DFlashDraft
from lumenrl_sddd.eagle3 import Eagle3Config, Eagle3Draft
from lumenrl_sddd.export import EXPORT_TENSORS, export_eagle3, load_draft, save_draft
from lumenrl_sddd.mori_engine import MoriTransferEngine
from lumenrl_sddd.tcp_engine import TCPTransferEngine
from lumenrl_sddd.vocab import draft_to_target, draft_vocab_maps

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU
V, H = 40, 32


def _eagle3(vocab: int = 24) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=8, vocab_size=V, draft_vocab_size=vocab, aux_layer_ids=[1, 1, 0]))
    counts = torch.arange(V).flip(0) * 3 + (torch.arange(V) % 5)
    d2t, t2d = draft_vocab_maps(counts, vocab)
    draft.d2t.copy_(d2t), draft.t2d.copy_(t2d)
    return draft


def _capture(b: int = 3, t: int = 12, pad: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :pad] = 0  # a left-padded row
    return {"input_ids": torch.randint(0, V, (b, t), generator=g), "attention_mask": mask,
            "hidden": torch.randn(b, t, 3 * H, generator=g), "logits": torch.randn(b, t, V, generator=g) * 3}


def test_layer_choice():
    assert eagle3_layer_ids(32) == [1, 15, 28]  # [1, N/2 - 1, N - 4]
    assert eagle3_layer_ids(4) == [1, 1, 0]
    assert dflash_layer_ids(32, 5) == [1, 8, 16, 23, 30]
    assert all(0 <= i < 3 for i in dflash_layer_ids(3, 3))


def test_draft_vocab_maps_keep_most_frequent():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocab_maps(counts, 3)
    assert t2d.tolist() == [False, False, True, True, False, True]
    assert draft_to_target(torch.arange(3), d2t).tolist() == [2, 3, 5]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab_maps(counts, 7)


def test_eagle3_ttt_loss_weights_and_gradients():
    draft, batch = _eagle3(), _capture()
    loss, metrics = draft.ttt_loss(batch, steps=3)
    weighted = sum(0.8**j * metrics[f"sddd/loss_step{j}"] for j in range(3))
    assert math.isclose(float(loss.detach()), weighted, rel_tol=1e-5)
    loss.backward()
    assert draft.fc.weight.grad.abs().sum() > 0 and draft.embed_tokens.weight.grad is None  # embedding frozen


def test_eagle3_step0_matches_inference_cache():
    """Step 0 of the training-time test equals the inference path's context entries (same function)."""
    draft, batch = _eagle3(), _capture(b=1, t=10, pad=0)
    draft.eval()
    ids, hidden = batch["input_ids"], batch["hidden"]
    # training view: logits of step 0 at the last position
    g = draft.fc(hidden)
    hid = torch.cat([g.new_zeros(1, 1, H), g[:, :-1]], 1)
    state = draft.start(1, 32, torch.device("cpu"))
    cols = torch.arange(1, 10)[None]
    seen = []
    draft.propose(state, tokens=ids[:, 1:], features=hidden[:, :-1], columns=cols, positions=cols, valid=torch.ones_like(
        cols, dtype=torch.bool), last=torch.tensor([8]), k=1, sample=lambda logits: seen.append(logits) or logits.argmax(-1))
    with torch.no_grad():
        loss_free = draft.midlayer.inputs(draft.embed_tokens(ids), hid)
        pos = torch.arange(10)[None]
        attn = draft.midlayer.self_attn
        k, v = attn.key_value(loss_free, pos)
        causal = torch.ones(10, 10, dtype=torch.bool).tril()
        causal[:, 0] = False
        causal |= torch.eye(10, dtype=torch.bool)
        from lumenrl_sddd.layers import attend
        out = draft.midlayer.finish(attend(attn.query(loss_free, pos), k, v, causal[None, None]), hid)
        expect = draft._logits(out)[0, -1]
    got = seen[0][0, draft.target_ids()]
    assert torch.allclose(got, expect, atol=1e-5)


def test_dflash_block_loss_and_position_weights():
    torch.manual_seed(0)
    draft = DFlashDraft(DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=8, vocab_size=V, block_size=4, aux_layer_ids=[0, 1, 2], anchors_per_seq=3))
    loss, metrics = draft.block_loss(_capture(), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and 0 <= metrics["sddd/block_acc"] <= 1
    loss.backward()
    assert draft.lm_head.weight.grad is None and draft.mask_embedding.grad.abs().sum() > 0


def test_tcp_engine_moves_tensors_bit_exactly():
    producer = TCPTransferEngine(port=0)
    try:
        tensors = {"hidden": torch.randn(2, 5, 7, dtype=torch.bfloat16), "ids": torch.arange(10)}
        producer.put("k1", tensors)
        consumer = TCPTransferEngine(connect=producer.address)
        got = consumer.get("k1")
        assert all(torch.equal(got[n], tensors[n]) and got[n].dtype == tensors[n].dtype for n in tensors)
        consumer.pop("k1")
        with pytest.raises(KeyError):
            consumer.get("k1")
        with pytest.raises(RuntimeError, match="cannot put"):
            consumer.put("x", tensors)
    finally:
        producer.close()


def test_tcp_engine_refuses_contradictory_arguments():
    producer = TCPTransferEngine(host="127.0.0.1", port=0)  # explicit bind address: a producer
    try:
        addr = producer.address
        for kwargs, match in [({"host": "0.0.0.0"}, r"host='0\.0\.0\.0' with connect="),
                              ({"port": 9000}, r"port=9000 with connect="),
                              ({"serve": True}, r"serve=True with connect=")]:
            with pytest.raises(ValueError, match=match):
                TCPTransferEngine(connect=addr, **kwargs)
        for kwargs, match in [({"host": "127.0.0.1"}, r"host='127\.0\.0\.1' with serve=False"),
                              ({"port": 0}, r"port=0 with serve=False")]:
            with pytest.raises(ValueError, match=match):
                TCPTransferEngine(serve=False, **kwargs)
        for bad in (0, -1.0, None):
            with pytest.raises(ValueError, match=rf"timeout={bad!r}; expected seconds > 0"):
                TCPTransferEngine(connect=addr, timeout=bad)
        producer.put("k", {"x": torch.arange(3)})
        consumer = TCPTransferEngine(connect=addr, serve=False)  # consistent: still a consumer
        assert torch.equal(consumer.get("k")["x"], torch.arange(3))
    finally:
        producer.close()
    local = TCPTransferEngine(serve=False)  # neither serves nor connects: a local store
    assert local.address is None
    local.put("k", {"x": torch.ones(2)})
    assert torch.equal(local.pop("k")["x"], torch.ones(2)) and local.keys() == []


def test_tcp_engine_timeout_is_read_on_both_sides():
    import socket
    import time

    producer = TCPTransferEngine(timeout=0.3)
    try:  # a consumer that connects and never sends its request: the producer drops it after ``timeout``
        with socket.create_connection(producer.address, timeout=30) as stalled:
            start = time.monotonic()
            assert stalled.recv(1) == b""  # closed by the producer, not held open
            assert time.monotonic() - start < 20
        producer.put("k", {"x": torch.arange(4)})  # the producer still serves
        assert torch.equal(TCPTransferEngine(connect=producer.address).get("k")["x"], torch.arange(4))
    finally:
        producer.close()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        consumer = TCPTransferEngine(connect=silent.getsockname()[:2], timeout=0.2)
        with pytest.raises(TimeoutError):
            consumer.get("k")


def test_mori_registered_and_unavailable_with_reason():
    from lumenrl_core.plugins import get_registry

    info = get_registry().info("transfer_engines", "mori")
    assert not info.available and "ROCm" in (info.reason or "")
    with pytest.raises(RuntimeError, match="unavailable"):
        MoriTransferEngine()


def test_eagle3_export_layout_and_reload(tmp_path):
    draft = _eagle3()
    export_eagle3(draft, tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 24 and cfg["target_hidden_size"] == H
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 2, 1], "use_aux_hidden_state": True}
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert set(tensors) == set(EXPORT_TENSORS)
    assert tensors["fc.weight"].shape == (H, 3 * H) and tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    save_draft(draft, tmp_path / "fp32")
    back = load_draft(tmp_path / "fp32")
    assert back.config.aux_layer_ids == [1, 1, 0]
    assert all(torch.equal(back.state_dict()[n], draft.state_dict()[n]) for n in EXPORT_TENSORS)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_context_committed_in_parts_proposes_as_one_call(kind):
    """The engine commits a prompt's context, then re-commits its last entries in the first round (fixed
    shapes for CUDA graphs): the proposals (and their logits) equal one propose over the whole context, also
    with a larger fixed kv_len."""
    if kind == "eagle3":
        draft, k = _eagle3(), 3
    else:
        torch.manual_seed(0)
        draft = DFlashDraft(DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, vocab_size=V, block_size=4, aux_layer_ids=[0, 1, 2]))
        k = 3
    draft.eval()
    cap, (b, t) = _capture(), _capture()["input_ids"].shape
    mask = cap["attention_mask"].bool()
    ctx = {"tokens": cap["input_ids"], "features": cap["hidden"], "columns": torch.arange(1, t + 1).expand(b, t),
           "positions": (mask.long().cumsum(1) - 1).clamp(min=0), "valid": mask}
    greedy = lambda logits: logits.argmax(-1)  # noqa: E731

    whole = draft.propose(draft.start(b, 40, torch.device("cpu")), k=k, sample=greedy,
                          last=torch.full((b,), t - 1), **ctx)
    state = draft.start(b, 40, torch.device("cpu"))
    draft.commit(state, **{key: value[:, :t - k - 1] for key, value in ctx.items()})
    parts = draft.propose(state, k=k, sample=greedy, last=torch.full((b,), k), kv_len=32,
                          **{key: value[:, t - k - 1:] for key, value in ctx.items()})
    assert torch.equal(whole[0], parts[0])
    assert torch.allclose(whole[1], parts[1], atol=1e-5)


@pytest.mark.parametrize("vocab", [24, V])
def test_compiled_chain_steps_propose_as_eager(vocab):
    """compile_inference: a chained step's pieces trace as whole graphs (fullgraph: no break; dynamo with the
    aot_eager backend here, inductor on CUDA) and propose the eager path's tokens and logits, at batch 3 and 1.
    A draft vocabulary that is the whole target vocabulary (vocab=V) skips the per-step scatter."""
    draft = _eagle3(vocab).eval()
    cap, (b, t) = _capture(), _capture()["input_ids"].shape
    mask = cap["attention_mask"].bool()
    ctx = {"tokens": cap["input_ids"], "features": cap["hidden"], "columns": torch.arange(1, t + 1).expand(b, t),
           "positions": (mask.long().cumsum(1) - 1).clamp(min=0), "valid": mask}
    greedy = lambda logits: logits.argmax(-1)  # noqa: E731
    outs = []
    for backend in (None, "aot_eager"):
        draft.compile_inference(backend)
        for rows in (b, 1):
            state = draft.start(rows, 40, torch.device("cpu"))
            outs.append(draft.propose(state, k=4, sample=greedy, last=torch.full((rows,), t - 1), kv_len=32,
                                      **{key: value[:rows] for key, value in ctx.items()}))
        assert draft.compiled == backend  # no compile failure (it would warn and fall back to eager)
    assert draft._identity_vocab == (vocab == V)
    for eager, compiled in zip(outs[:2], outs[2:]):
        assert torch.equal(eager[0], compiled[0])
        assert torch.allclose(eager[1], compiled[1], atol=1e-5)
        assert torch.isinf(eager[1]).any() == (vocab < V)  # outside a partial draft vocabulary: -inf


def test_decode_attend_packs_query_heads_and_shares_rope_tables():
    """One query per row (the draft's chained steps): the group's heads packed onto their KV head (no
    repeat_interleave copy of the draft cache) give float64 GQA attention; RoPE tables made once for query
    and key give what apply_rope makes from the positions, bit for bit."""
    from lumenrl_sddd.layers import apply_rope, attend, rope_tables

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 8, 1, 16, generator=gen), torch.randn(3, 2, 20, 16, generator=gen), torch.randn(
        3, 2, 20, 16, generator=gen)
    allowed = torch.rand(3, 1, 1, 20, generator=gen) > 0.3
    allowed[..., 0] = True
    out = attend(q, k, v, allowed)  # (B, 1, H * D)
    k64, v64 = k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1)
    scores = (q.double() @ k64.transpose(-1, -2) / 4.0).masked_fill(~allowed, float("-inf"))
    ref = (scores.softmax(-1) @ v64).transpose(1, 2).flatten(2)
    assert out.shape == (3, 1, 128) and float((out.double() - ref).norm() / ref.norm()) < 1e-6
    positions = torch.randint(0, 500, (3, 4), generator=gen)
    x = torch.randn(3, 2, 4, 16, generator=gen)
    tables = rope_tables(positions, 16, 1e6, x.dtype)
    assert torch.equal(apply_rope(x, positions, 1e6, tables), apply_rope(x, positions, 1e6))


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_draft_rmsnorm_against_float64(dtype, bound):
    from lumenrl_sddd.layers import RMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    x = torch.randn(5, 3, 64, generator=gen) * 3
    norm, x = norm.to(dtype), x.to(dtype)
    x64, w64 = x.double(), norm.weight.detach().double()
    ref = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w64
    with torch.no_grad():
        out = norm(x)
    assert out.dtype == dtype and float((out.double() - ref).norm() / ref.norm()) < bound
