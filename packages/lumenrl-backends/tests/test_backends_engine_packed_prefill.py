"""Packed prefill (``pack_prefill``): contexts back to back in one batch row, no padding, each token written to its
own slot and column. Its logits and cache contents against a float64 forward per context, whole generations against
the left-padded prefill (fresh and continued after a weight update), the plan that splits admissions between graphed
and packed prefills, where it is off, and on CUDA the varlen flash attention against the masked path."""

from __future__ import annotations

import copy

import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.engines.kv_cache import packed_mask
from lumenrl_backends.engines.requests import Request
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it, and why?", "9", "abc def, ghi?", "100-1="]


@pytest.fixture()
def loaded(qwen3_dir):
    return load_model_and_tokenizer(str(qwen3_dir), dtype="float32")


def prompt_batch(tokenizer, prompts=PROMPTS) -> DataProto:
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def generate_interrupted(engine: NativeEngine, batch: DataProto, params: dict, *, steps: int) -> DataProto:
    """``engine.generate`` interrupted after ``steps`` decode steps (the engine is left interrupted)."""
    decode, count = engine._decode, {"n": 0}

    def counted(*args, **kwargs):
        decode(*args, **kwargs)
        count["n"] += 1
        if count["n"] == steps:
            engine.interrupt()

    engine._decode = counted
    try:
        return engine.generate(batch, params)
    finally:
        engine._decode = decode


def random_contexts(gen: torch.Generator, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_packed_mask_is_causal_within_each_sequence_only():
    lengths = torch.tensor([3, 1, 4])
    mask = packed_mask(lengths, 8)[0, 0]
    starts = [0, 3, 4]
    for q in range(8):
        for k in range(8):
            seq_q = max(i for i, s in enumerate(starts) if s <= q)
            seq_k = max(i for i, s in enumerate(starts) if s <= k)
            assert bool(mask[q, k]) == (seq_q == seq_k and k <= q), (q, k)


def test_packed_prefill_logits_and_cache_match_a_float64_forward_per_context(loaded):
    """Contexts of 1 to 37 tokens packed into slots 5, 0, 3, 1: each one's last logits, and every layer's cached keys
    and values at columns 0..len - 1, are a float64 forward of that context alone within float32's bound; the
    columns past it are invalid."""
    model, tokenizer = loaded
    reference = copy.deepcopy(model).double()  # before the engine fuses the model's projections
    engine = NativeEngine(model, tokenizer, max_batch_size=6, max_seq_len=48, pack_prefill="on")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = [int(n) for n in torch.randint(1, 38, (4,), generator=gen)]
    contexts = random_contexts(gen, model.config.vocab_size, lengths)
    slots = [5, 0, 3, 1]
    engine.cache.valid[:] = True  # stale validity from an earlier occupant: the prefill clears it
    with torch.no_grad():
        logits = engine.prefill.packed(contexts, torch.tensor(slots))
    assert logits.shape == (4, model.config.vocab_size)
    for i, (context, slot) in enumerate(zip(contexts, slots)):
        with torch.no_grad():
            out = reference(torch.tensor([context]), use_cache=True)
        scale = out.logits[0, -1].abs().max()
        assert (logits[i].double() - out.logits[0, -1]).abs().max() <= 1e-4 * scale, (i, len(context))
        n = len(context)
        assert engine.cache.valid[slot, :n].all() and not engine.cache.valid[slot, n:].any()
        for layer, cached in zip(engine.cache.layers, out.past_key_values.layers):
            for got, want in ((layer.keys, cached.keys), (layer.values, cached.values)):
                error = (got[slot, :, :n].double() - want[0]).abs().max()
                assert error <= 1e-4 * want.abs().max(), (i, error)


def test_generations_equal_the_left_padded_prefill(loaded):
    """Greedy rows of unlike lengths, every sample count: tokens equal and log-probs within float32's bound of the
    left-padded prefill's; the packed engine ran packed prefills (on the CPU every prefill, no graphs)."""
    model, tokenizer = loaded
    batch = prompt_batch(tokenizer)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    outs = {}
    for pack in (True, False):
        engine = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=64, pack_prefill="on" if pack else "off")
        outs[pack] = engine.generate(batch, params)
        assert (engine.prefill.packed_calls > 0) == pack
    assert torch.equal(outs[True].batch["responses"], outs[False].batch["responses"])
    assert torch.allclose(outs[True].batch["rollout_log_probs"], outs[False].batch["rollout_log_probs"], atol=1e-4)


def test_rows_continued_after_a_weight_update_prefill_packed_as_the_padded_path_does(loaded):
    """Partial rollout: rows interrupted mid-response and continued under new weights are re-prefilled (prompt and
    response so far) in one packed forward; the finished generations equal the left-padded engine's, and a group's
    rows still copy their lead's prefill."""
    model, tokenizer = loaded
    prompts = [p for p in PROMPTS[:3] for _ in range(3)] + PROMPTS[3:]
    batch = prompt_batch(tokenizer, prompts)
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 11, "ignore_eos": True}
    gen = torch.Generator().manual_seed(4)
    new_weights = {n: p.detach() + 0.2 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    outs, packed_calls = {}, {}
    for pack in (True, False):
        engine = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=16, max_seq_len=64,
                              pack_prefill="on" if pack else "off")
        partial = generate_interrupted(engine, batch, params, steps=5)
        engine.update_weights(new_weights, 2)
        engine.resume()
        calls = engine.prefill.packed_calls
        outs[pack] = engine.generate(partial, params)
        packed_calls[pack] = engine.prefill.packed_calls - calls
        assert engine.prefill_rows["shared"] > 0
    assert packed_calls == {True: 1, False: 0}  # all continued rows in one forward
    assert torch.equal(outs[True].batch["responses"], outs[False].batch["responses"])
    assert torch.allclose(outs[True].batch["rollout_log_probs"], outs[False].batch["rollout_log_probs"], atol=1e-4)


@pytest.mark.parametrize("v_tiles", [False, True])
def test_an_fp8_cache_after_calibration_prefills_packed_as_the_padded_path_does(loaded, v_tiles):
    """FP8 KV cache (V in rows or in tiles): the first prefill calibrates the scales (left-padded), the rows continued
    after an interrupt are prefilled packed into the FP8 slots; the generations equal the padded engine's within
    the bound of an FP8 code's rounding."""
    from lumenrl_backends.engines import KernelOptions

    model, tokenizer = loaded
    batch = prompt_batch(tokenizer, PROMPTS)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    outs, packed_calls = {}, {}
    for pack in ("on", "off"):
        engine = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=8, max_seq_len=64, kv_cache_dtype="fp8",
                              kernels=KernelOptions(kv_v_tiles=v_tiles), pack_prefill=pack)
        engine.keep_kv_on_update = False
        partial = generate_interrupted(engine, batch, params, steps=4)
        engine._kept.free()  # the interrupted rows prefill again, as after a weight update
        engine.resume()
        outs[pack] = engine.generate(partial, params)
        packed_calls[pack] = engine.prefill.packed_calls
    assert packed_calls == {"on": 1, "off": 0}
    assert torch.equal(outs["on"].batch["responses"], outs["off"].batch["responses"])
    assert torch.allclose(outs["on"].batch["rollout_log_probs"], outs["off"].batch["rollout_log_probs"], atol=5e-3)


def test_the_plan_graphs_small_chunks_and_packs_the_rest(loaded):
    """With graphed shapes (buckets on): chunks a graph holds stay left-padded, every other row goes into packed
    chunks of at most ``prefill_chunk_tokens`` real tokens; each row once."""
    model, tokenizer = loaded
    engine = NativeEngine(model, tokenizer, max_batch_size=64, max_seq_len=512, prefill_chunk_tokens=700,
                          pack_prefill="on")
    engine.prefill.buckets = True
    gen = torch.Generator().manual_seed(2)
    lengths = sorted((int(n) for n in torch.randint(4, 300, (40,), generator=gen)), reverse=True)
    requests = [Request(index=i, prompt=[1] * n, seed=i) for i, n in enumerate(lengths)]
    plan = engine.prefill.plan(requests, room=16)
    seen = sorted(r.index for chunk, _ in plan for r in chunk)
    assert seen == list(range(40))
    assert any(packed for _, packed in plan) and any(not packed for _, packed in plan)
    for chunk, packed in plan:
        width = max(len(r.context) for r in chunk)
        if packed:
            assert sum(len(r.context) for r in chunk) <= 700 or len(chunk) == 1
        else:
            assert engine.prefill.key(len(chunk), width, 16) is not None
    engine.prefill.pack = "off"
    assert all(not packed for _, packed in engine.prefill.plan(requests, room=16))


def test_not_packed_where_a_prefill_must_run_its_own_shape(loaded, qwen3_dir):
    """``auto`` packs only where the varlen kernel runs (not on the CPU: a (T, T) mask costs more than padding);
    exact log-probs (the trainer's shapes), R3 (routes per padded row) and a sliding window keep the padded prefill
    even with ``on``; ``off`` never packs; any other value is refused."""
    model, tokenizer = loaded
    assert NativeEngine(model, tokenizer, max_batch_size=4, pack_prefill="on").prefill.packable()
    assert not NativeEngine(model, tokenizer, max_batch_size=4).prefill.packable()  # auto, CPU
    assert not NativeEngine(model, tokenizer, max_batch_size=4, pack_prefill="off").prefill.packable()
    exact_model, _ = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    exact = NativeEngine(exact_model, tokenizer, max_batch_size=4, exact_logprobs=True, pack_prefill="on")
    assert not exact.prefill.packable()
    windowed = NativeEngine(model, tokenizer, max_batch_size=4, pack_prefill="on")
    windowed.window = 8
    assert not windowed.prefill.packable()
    with pytest.raises(ValueError, match="pack_prefill=True; allowed: auto"):
        NativeEngine(model, tokenizer, pack_prefill=True)


def test_pack_prefill_is_read_from_the_config(qwen3_dir):
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.policy.model_name = str(qwen3_dir)
    config.policy.rollout.max_batch_size, config.cluster.device = 4, "cpu"
    assert NativeEngine.from_config(config).prefill.pack == "auto"
    config.policy.rollout.pack_prefill = "on"
    assert NativeEngine.from_config(config).prefill.packable()


def test_another_threads_attention_during_an_engine_forward_is_transformers_own():
    """The engine's attention entry is process-wide while its forward runs: a trainer thread's attention call in that
    window (here while a packed prefill's varlen view is active, and a decode view whose batch matches) gets
    transformers' ``sdpa`` result, not the engine's view applied to its tensors."""
    import threading

    from lumenrl_backends.engines import attention
    from lumenrl_backends.engines.kv_cache import CacheView, SlotKVCache

    cache = SlotKVCache(num_layers=1, max_slots=2, max_len=16, device=torch.device("cpu"))
    views = [CacheView(rows=torch.zeros(1, 9, dtype=torch.int64), columns=torch.arange(9)[None], decode=False,
                       kv_len=9, segments=torch.tensor([0, 4, 9], dtype=torch.int32), longest=5, varlen=True),
             CacheView(rows=torch.arange(2), columns=torch.tensor([[3], [6]]), decode=True, kv_len=8)]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for view, q_len in zip(views, (5, 1)):
        query = torch.randn(2, 4, q_len, 8, generator=gen)
        key, value = (torch.randn(2, 2, 8, 8, generator=gen) for _ in range(2))
        mask = torch.rand(2, 1, q_len, 8, generator=gen) < 0.7
        mask[..., 0] = True
        want = attention._original_sdpa()(module, query, key, value, mask, scaling=0.3)[0]
        entered, done = threading.Event(), threading.Event()

        def engine_forward(view=view, entered=entered, done=done):
            with attention.engine_attention(cache):
                cache.set_view(view)
                entered.set()
                done.wait(30)
            cache.set_view(None)

        thread = threading.Thread(target=engine_forward)
        thread.start()
        assert entered.wait(30)
        try:
            got = attention.packed_decode_attention(module, query, key, value, mask, scaling=0.3)[0]
        finally:
            done.set()
            thread.join(30)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_varlen_packed_prefill_matches_a_float64_forward_and_the_training_forward(qwen3_dir, monkeypatch):
    """CUDA, bf16: the packed prefill runs torch's varlen flash attention; each context's last logits are a float64
    forward of it alone within bf16's bound (no worse than the block-diagonal masked path's), and a batch too large for
    a prefill graph (packed) generates log-probs that the training forward matches within bf16's bound."""
    import lumenrl_backends.engines.prefill as prefill_module
    from lumenrl_backends.engines import attention

    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="bfloat16", device="cuda")
    reference = copy.deepcopy(model).double()
    engine = NativeEngine(model, tokenizer, device="cuda", max_batch_size=32, max_seq_len=256)
    assert attention.varlen_ok(torch.device("cuda"), torch.bfloat16, engine.prefill._head_dim)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = [int(n) for n in torch.randint(1, 200, (6,), generator=gen)]
    contexts = random_contexts(gen, model.config.vocab_size, lengths)
    rows = torch.arange(6, device="cuda")
    errors = {}
    for varlen in (True, False):
        if not varlen:
            monkeypatch.setattr(prefill_module, "varlen_ok", lambda *args: False)
        with torch.no_grad():
            logits = engine.prefill.packed(contexts, rows).double()
        worst = 0.0
        for i, context in enumerate(contexts):
            with torch.no_grad():
                want = reference(torch.tensor([context], device="cuda")).logits[0, -1]
            worst = max(worst, float((logits[i] - want).abs().max() / want.abs().max()))
        errors[varlen] = worst
    assert errors[True] < 5e-2 and errors[True] < 2 * errors[False] + 1e-2, errors
    monkeypatch.undo()

    prompts = [tokenizer.decode(c) for c in random_contexts(gen, model.config.vocab_size, [100] * 24)]
    batch = prompt_batch(tokenizer, prompts)
    calls = engine.prefill.packed_calls
    out = engine.generate(batch, {"temperature": 1.0, "max_new_tokens": 16, "seed": 2, "ignore_eos": True})
    assert engine.prefill.packed_calls > calls  # 24 rows x 128 padded columns or more: no prefill graph
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"].cuda(), attention_mask=out.batch["attention_mask"].cuda()).logits
    width = out.batch["prompts"].shape[1]
    reference_lp = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(
        2, out.batch["responses"].cuda()[..., None]).squeeze(-1).cpu()
    mask = out.batch["response_mask"].bool()
    assert (reference_lp - out.batch["rollout_log_probs"])[mask].abs().mean() < 2e-2
