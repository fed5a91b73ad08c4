"""NativeEngine on a tiny Qwen3 (CPU, fp32): parity with HF and with the training forward,
sampling, stops, lengths, weight updates, interrupt/resume and continuous batching."""

from __future__ import annotations

import threading

import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc def, ghi?", "100-1="]


@pytest.fixture()
def loaded(qwen3_dir):
    return load_model_and_tokenizer(str(qwen3_dir), dtype="float32")


def prompt_batch(tokenizer, prompts=PROMPTS) -> DataProto:
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def engine_for(loaded, **kwargs) -> NativeEngine:
    model, tokenizer = loaded
    return NativeEngine(model, tokenizer, **{"max_batch_size": 8, "max_seq_len": 64, **kwargs})


def training_log_probs(model, out: DataProto, temperature: float = 1.0, use_positions: bool = False) -> torch.Tensor:
    """What a trainer computes: full forward on prompt ++ response, log_softmax gathered."""
    kwargs = {"position_ids": out.batch["position_ids"]} if use_positions else {}
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"], **kwargs).logits
    width = out.batch["prompts"].shape[1]
    logits = logits[:, width - 1 : -1].float() / temperature  # predicts response tokens
    return torch.log_softmax(logits, dim=-1).gather(2, out.batch["responses"][..., None]).squeeze(-1)


def test_output_layout(loaded):
    tokenizer = loaded[1]
    batch = prompt_batch(tokenizer)
    out = engine_for(loaded).generate(batch, {"temperature": 0.0, "max_new_tokens": 10})
    rows, width = batch.batch["input_ids"].shape
    assert len(out) == rows
    assert out.batch["responses"].shape == (rows, 10)
    assert out.batch["input_ids"].shape == (rows, width + 10)
    assert torch.equal(out.batch["prompts"], batch.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"][:, width:], out.batch["responses"])
    assert torch.equal(out.batch["attention_mask"][:, width:], out.batch["response_mask"])
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    assert (out.batch["rollout_log_probs"] <= 0).all()
    assert (out.batch["rollout_log_probs"][out.batch["response_mask"] == 0] == 0).all()
    pos = out.batch["position_ids"]
    first_real = out.batch["attention_mask"].argmax(dim=1)
    assert (pos[torch.arange(rows), first_real] == 0).all()
    texts = tokenizer.batch_decode(
        [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])],
        skip_special_tokens=True,
    )
    assert list(out.non_tensor_batch["response_text"]) == texts
    assert out.meta_info["perf"]["tokens"] == int(out.batch["response_mask"].sum())
    assert out.meta_info["interrupted"] is False


def test_prefill_is_a_profiler_range_inside_generate(loaded):
    """Each admission's prefill runs inside a ``lumenrl/prefill`` range (benchmarks' traces split a step's GPU time
    by such ranges); the decode loop is outside it."""
    from torch.profiler import ProfilerActivity, profile

    engine = engine_for(loaded, max_batch_size=4)  # 6 prompts, 4 slots: a second admission mid-generation
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompt_batch(loaded[1]), {"temperature": 0.0, "max_new_tokens": 4})
    ranges = [e for e in prof.events() if e.name == "lumenrl/prefill"]
    assert len(ranges) >= 2  # the first 4 rows, then the rest as slots free up
    assert all(e.time_range.elapsed_us() > 0 for e in ranges)


def test_greedy_matches_hf_generate(loaded):
    model, tokenizer = loaded
    batch = prompt_batch(tokenizer)
    out = engine_for(loaded).generate(batch, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
    hf = model.generate(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                        max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(out.batch["responses"], hf[:, batch.batch["input_ids"].shape[1] :])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_training_forward(loaded, temperature):
    model, tokenizer = loaded
    batch = prompt_batch(tokenizer)  # left-padded, prompt lengths 1..20
    out = engine_for(loaded).generate(batch, {"temperature": temperature, "max_new_tokens": 24, "seed": 11})
    mask = out.batch["response_mask"].bool()
    assert mask.sum() > 30
    for use_positions in (False, True):
        delta = (training_log_probs(model, out, temperature, use_positions) - out.batch["rollout_log_probs"])[mask]
        assert delta.abs().mean() < 1e-4, delta.abs().mean()
        assert delta.abs().max() < 1e-3


def test_seeded_sampling_is_reproducible_and_batch_independent(loaded):
    tokenizer = loaded[1]
    engine = engine_for(loaded)
    batch = prompt_batch(tokenizer)
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 5, "ignore_eos": True}
    first, second = engine.generate(batch, params), engine.generate(batch, params)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    other = engine.generate(batch, {**params, "seed": 6})
    assert not torch.equal(first.batch["responses"], other.batch["responses"])
    # a request's draws depend on its own seed only, not on its neighbours or its slot
    single = prompt_batch(tokenizer, PROMPTS[2:3])
    single.non_tensor_batch["sampling_seed"] = first.non_tensor_batch["seed"][2:3]
    alone = engine.generate(single, params)
    width = single.batch["input_ids"].shape[1]
    assert torch.equal(alone.batch["responses"][0], first.batch["responses"][2])
    assert torch.equal(alone.batch["input_ids"][0, width:], first.batch["responses"][2])
    # a stale "seed" column on a fresh (e.g. repeated) batch is ignored, so group rows differ
    repeated = prompt_batch(tokenizer, PROMPTS[:1] * 4)
    repeated.non_tensor_batch["seed"] = [7, 7, 7, 7]
    group = engine.generate(repeated, params)
    assert len({tuple(r) for r in group.batch["responses"].tolist()}) == 4


def test_seed_none_follows_torch_manual_seed(loaded):
    engine, batch = engine_for(loaded), prompt_batch(loaded[1])
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
    torch.manual_seed(3)
    a = engine.generate(batch, params)
    torch.manual_seed(3)
    b = engine.generate(batch, params)
    assert torch.equal(a.batch["responses"], b.batch["responses"])


def test_top_k_one_is_greedy_and_top_k_restricts_support(loaded):
    model, tokenizer = loaded
    engine, batch = engine_for(loaded), prompt_batch(tokenizer)
    greedy = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
    top1 = engine.generate(batch, {"temperature": 1.3, "top_k": 1, "max_new_tokens": 10, "ignore_eos": True, "seed": 2})
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])
    out = engine.generate(batch, {"temperature": 1.0, "top_k": 3, "max_new_tokens": 10, "ignore_eos": True, "seed": 4})
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    ranks = (logits[:, width - 1 : -1] > logits[:, width - 1 : -1].gather(2, out.batch["responses"][..., None])).sum(-1)
    assert (ranks[out.batch["response_mask"].bool()] < 3).all()  # every drawn token is among the top 3


def test_top_p_restricts_support(loaded):
    model, tokenizer = loaded
    engine, batch = engine_for(loaded), prompt_batch(tokenizer)
    out = engine.generate(batch, {"temperature": 1.0, "top_p": 0.5, "max_new_tokens": 10, "ignore_eos": True, "seed": 9})
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    probs = logits[:, width - 1 : -1].float().softmax(-1)  # (B, T, V)
    chosen = probs.gather(2, out.batch["responses"][..., None])
    mass_above = (probs * (probs > chosen)).sum(-1)  # mass of strictly more likely tokens
    assert (mass_above[out.batch["response_mask"].bool()] < 0.5 + 1e-5).all()


def test_stop_tokens_end_sequences_and_masks(loaded):
    tokenizer = loaded[1]
    engine, batch = engine_for(loaded), prompt_batch(tokenizer)
    free = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
    stop = int(free.batch["responses"][0, 3])
    out = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "stop_token_ids": [stop]})
    for row in range(len(batch)):
        full = free.batch["responses"][row].tolist()
        expected = full[: full.index(stop) + 1] if stop in full else full
        n = len(expected)
        assert out.batch["responses"][row, :n].tolist() == expected
        assert out.batch["response_mask"][row].tolist() == [1] * n + [0] * (16 - n)
        assert (out.batch["responses"][row, n:] == tokenizer.pad_token_id).all()
        assert out.non_tensor_batch["finish_reason"][row] == ("stop" if stop in full else "length")
    assert out.non_tensor_batch["finish_reason"][0] == "stop"


def test_eos_stops_unless_ignored(loaded):
    tokenizer = loaded[1]
    engine, batch = engine_for(loaded), prompt_batch(tokenizer)
    eos = tokenizer.eos_token_id
    out = engine.generate(batch, {"temperature": 1.0, "max_new_tokens": 40, "seed": 0})
    for row in range(len(batch)):
        tokens = out.batch["responses"][row][out.batch["response_mask"][row].bool()].tolist()
        assert eos not in tokens[:-1]
        assert (tokens[-1] == eos) == (out.non_tensor_batch["finish_reason"][row] == "stop")
    ignored = engine.generate(batch, {"temperature": 1.0, "max_new_tokens": 40, "seed": 0, "ignore_eos": True})
    assert (ignored.batch["response_mask"].sum(1) == 40).all()


def test_max_seq_len_bounds_total_length(loaded):
    tokenizer = loaded[1]
    engine = engine_for(loaded, max_seq_len=24)
    batch = prompt_batch(tokenizer)  # padded prompt width 20
    out = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
    # a row's prefill pads it to its chunk's width (rows under half of it start another chunk): its response fills
    # the slot's columns past that width, plus the last token; the longest prompt's row: 4 written columns + 1
    own = batch.batch["attention_mask"].sum(1)
    got = out.batch["response_mask"].sum(1)
    assert got[own.argmax()] == 24 - 20 + 1
    assert ((own + got <= 24 + 1) & ((got == 16) | (2 * own + got >= 24 + 1))).all() and (got < 16).any()
    assert set(out.non_tensor_batch["finish_reason"]) == {"length"}
    with pytest.raises(ValueError, match="max_seq_len"):
        engine_for(loaded, max_seq_len=12).generate(batch, {"max_new_tokens": 4})


def test_continuous_batching_matches_one_big_batch(loaded):
    tokenizer = loaded[1]
    batch = prompt_batch(tokenizer, PROMPTS * 3)  # 18 rows through 4 slots
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 21}
    small = engine_for(loaded, max_batch_size=4).generate(batch, params)
    big = engine_for(loaded, max_batch_size=32).generate(batch, params)
    assert torch.equal(small.batch["responses"], big.batch["responses"])
    assert torch.allclose(small.batch["rollout_log_probs"], big.batch["rollout_log_probs"], atol=1e-5)


def _bucketed(engine: NativeEngine) -> list[tuple]:
    """Turn on the bucketed prefill shapes that CUDA graphs replay (eager here: no graphs on CPU); returns the
    list the (rows, width, hidden layers) keys of the bucketed prefills are appended to."""
    keys: list[tuple] = []
    step = engine.prefill.graphs.step
    engine.prefill.buckets = True
    engine.prefill.graphs.step = lambda *key: keys.append(key) or step(*key)
    return keys


@pytest.mark.parametrize("max_batch_size", [8, 4])
def test_bucketed_prefill_equals_own_width(loaded, max_batch_size):
    """Small prefills at bucketed shapes (rows up to a decode bucket, the last row repeated; width up to a power of
    two >= 16, more left padding, the response starting there) give the tokens and log-probs of prefills at the
    prompts' own width, through continuous batching (4 slots: admissions of 1 to 4 rows)."""
    tokenizer = loaded[1]
    batch = prompt_batch(tokenizer, PROMPTS * 2)  # padded prompt width 20
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 4}
    plain = engine_for(loaded, max_batch_size=max_batch_size).generate(batch, params)
    engine = engine_for(loaded, max_batch_size=max_batch_size)
    keys = _bucketed(engine)
    out = engine.generate(batch, params)
    assert keys and {width for _, width, _ in keys} <= {16, 32}
    assert all(rows in engine.buckets for rows, _, _ in keys)
    assert torch.equal(out.batch["responses"], plain.batch["responses"])
    assert torch.allclose(out.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5)
    assert list(out.non_tensor_batch["finish_reason"]) == list(plain.non_tensor_batch["finish_reason"])


def test_small_prefills_share_few_shapes(loaded):
    """A graphed prefill's rows are bucketed up to at least PREFILL_MIN_TOKENS padded tokens: admissions of 1 to 8
    short prompts are one shape (each shape is a capture), larger ones keep their own bucket."""
    from lumenrl_backends.engines.prefill import PREFILL_MIN_TOKENS

    engine = engine_for(loaded, max_batch_size=32, max_seq_len=256)
    engine.prefill.buckets = True
    assert PREFILL_MIN_TOKENS == 256
    assert {engine.prefill.key(n, 20, room=16) for n in range(1, 9)} == {(8, 32)}
    assert engine.prefill.key(9, 20, room=16) == (16, 32)
    assert {engine.prefill.key(n, 10, room=16) for n in (1, 16)} == {(16, 16)}
    assert engine.prefill.key(3, 100, room=16) == (4, 128)  # 2 rows would do; 4: 512 tokens at this width
    assert engine.prefill.key(20, 100, room=16) is None  # 32 x 128 > PREFILL_GRAPH_TOKENS: eager


def test_bucketed_prefill_keeps_room_for_the_response(loaded):
    """Where the padded width (32 for the longer prompts) would leave less than max_new_tokens columns, the prefill
    runs at its own width (20) and every row still gets its max_new_tokens."""
    tokenizer = loaded[1]
    engine = engine_for(loaded, max_seq_len=40)
    keys = _bucketed(engine)
    batch = prompt_batch(tokenizer)
    out = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
    assert all(width + 12 <= engine.max_seq_len for _, width, _ in keys)  # only chunks of shorter prompts
    assert keys and engine.prefill.eager["calls"] >= 1  # the longer ones ran eagerly at their own width
    assert (out.batch["response_mask"].sum(1) == 12).all()


def test_update_weights_in_place_changes_outputs(loaded):
    model, tokenizer = loaded
    engine, batch = engine_for(loaded), prompt_batch(tokenizer)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    before = engine.generate(batch, params)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    assert engine.update_weights(new.items(), version=3) == len(new)
    assert engine.weight_version == 3
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
    after = engine.generate(batch, params)
    assert not torch.equal(before.batch["responses"], after.batch["responses"])
    assert after.meta_info["weight_version"] == 3
    with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj.weight"):
        engine.update_weights({"model.layers.0.mlp.up_proj.weigh": torch.zeros(1)}, version=4)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=4)


def test_update_weights_tied_embeddings(tiny_model_dir):
    path = tiny_model_dir("qwen3", seed=1, tie_word_embeddings=True)
    model, tokenizer = load_model_and_tokenizer(str(path))
    engine = NativeEngine(model, tokenizer, max_batch_size=2, max_seq_len=32)
    embed = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == embed.data_ptr()
    pointer, value = embed.data_ptr(), torch.randn(embed.shape)
    engine.update_weights([("lm_head.weight", value)], version=1)  # either tied name works
    assert embed.data_ptr() == pointer and torch.equal(embed, value) and torch.equal(model.lm_head.weight, value)
    engine.update_weights([("_orig_mod.model.embed_tokens.weight", value * 2)], version=2)  # wrapper prefix
    assert torch.equal(model.lm_head.weight, value * 2)


def _interrupt_after(engine: NativeEngine, steps: int) -> None:
    """Make the engine's decode loop call interrupt() after ``steps`` decode steps."""
    original, count = engine._decode, {"n": 0}

    def counted(*args, **kwargs):
        original(*args, **kwargs)
        count["n"] += 1
        if count["n"] == steps:
            engine.interrupt()

    engine._decode = counted


def test_interrupt_then_resume_equals_uninterrupted(loaded):
    tokenizer = loaded[1]
    batch = prompt_batch(tokenizer)
    params = {"temperature": 1.0, "max_new_tokens": 20, "seed": 13, "ignore_eos": True}
    full = engine_for(loaded).generate(batch, params)
    engine = engine_for(loaded, max_batch_size=4)  # also leaves rows queued, never started
    _interrupt_after(engine, 5)
    partial = engine.generate(batch, params)
    assert partial.meta_info["interrupted"] is True
    reasons = list(partial.non_tensor_batch["finish_reason"])
    assert set(reasons) == {"interrupted"}
    lengths = partial.batch["response_mask"].sum(1)
    assert lengths.max() == 6 and lengths.min() == 0  # prefill token + 5 decode steps; queued rows empty
    assert engine.interrupted
    assert not engine.generate(partial, params).batch["response_mask"].sum() > lengths.sum()  # still stopped
    engine.resume()
    engine._decode = NativeEngine._decode.__get__(engine)
    prefilled = _count_prefill_rows(engine)
    done = engine.generate(partial, params)
    assert done.meta_info["interrupted"] is False
    assert torch.equal(done.batch["responses"], full.batch["responses"])
    assert torch.allclose(done.batch["rollout_log_probs"], full.batch["rollout_log_probs"], atol=1e-5)
    # the 4 started rows continued in their slots (their caches kept): only the never-started rows were prefilled
    assert engine.kept_slots["reclaimed"] >= 4 and prefilled["rows"] == int((lengths == 0).sum())


class _PrefilledRows(dict):
    """``["rows"]``: the rows the engine has run a prefill forward for since this was made (padded or packed)."""

    def __init__(self, engine: NativeEngine) -> None:
        super().__init__()
        self.engine, self.start = engine, engine.prefill_rows["prefilled"]

    def __getitem__(self, key: str) -> int:
        assert key == "rows"
        return self.engine.prefill_rows["prefilled"] - self.start


def _count_prefill_rows(engine: NativeEngine) -> _PrefilledRows:
    return _PrefilledRows(engine)


def test_kept_slots_are_freed_for_other_rows_and_other_sampling(loaded):
    """Rows that continue no kept row (another batch; the same rows under another sampler) are prefilled, the kept
    slots freed for them, and the outputs are a fresh engine's."""
    tokenizer = loaded[1]
    batch = prompt_batch(tokenizer)
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 5, "ignore_eos": True}
    engine = engine_for(loaded)
    _interrupt_after(engine, 3)
    partial = engine.generate(batch, params)
    engine._decode = NativeEngine._decode.__get__(engine)
    engine.resume()
    kept = engine.kept_slots["kept"]
    assert kept == len(batch)
    other = prompt_batch(tokenizer, PROMPTS[::-1])
    prefilled = _count_prefill_rows(engine)
    got = engine.generate(other, params)
    assert engine.kept_slots["freed"] == kept and engine.kept_slots["reclaimed"] == 0
    assert prefilled["rows"] == len(other)
    assert torch.equal(got.batch["responses"], engine_for(loaded).generate(other, params).batch["responses"])
    # the same continuation under another sampler: not reclaimed (its slots' sampler settings differ)
    _interrupt_after(engine, 3)
    partial = engine.generate(batch, params)
    engine._decode = NativeEngine._decode.__get__(engine)
    engine.resume()
    greedy = {**params, "temperature": 0.0}
    engine.generate(partial, greedy)
    assert engine.kept_slots["reclaimed"] == 0
    assert sorted(engine.slots.free) == list(range(engine.max_batch_size))  # nothing left kept at the end


def test_resume_under_new_weights(loaded):
    model, tokenizer = loaded
    batch = prompt_batch(tokenizer)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    engine = engine_for(loaded)
    full_old = engine.generate(batch, params)
    _interrupt_after(engine, 4)
    partial = engine.generate(batch, params)
    engine._decode = NativeEngine._decode.__get__(engine)
    gen = torch.Generator().manual_seed(1)
    freed = engine.kept_slots["freed"]
    engine.update_weights({n: p + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}, 7)
    assert engine.kept_slots["freed"] - freed == len(batch)  # their caches hold the old weights' keys and values
    engine.resume()
    done = engine.generate(partial, params)
    kept = partial.batch["response_mask"].bool()
    assert torch.equal(done.batch["responses"][kept], full_old.batch["responses"][kept])  # old prefix kept
    assert torch.equal(done.batch["rollout_log_probs"][kept], partial.batch["rollout_log_probs"][kept])
    assert not torch.equal(done.batch["responses"], full_old.batch["responses"])  # continued under new weights
    assert done.meta_info["weight_version"] == 7
    # new tokens' log-probs are those of the new weights on the mixed sequence
    fresh = ~kept & done.batch["response_mask"].bool()
    delta = (training_log_probs(model, done) - done.batch["rollout_log_probs"])[fresh]
    assert delta.abs().mean() < 1e-4


def test_kept_kv_across_a_weight_update_continues_on_the_old_cache(loaded):
    """keep_kv_on_update (async_training.resume_kv=keep): an interrupted row continues in its slot after
    update_weights, no prefill; its new tokens are what the new weights predict from the keys and values the old
    weights cached (float64 reference: HF's cache filled by the old model, continued by the new one)."""
    import copy

    model, tokenizer = loaded
    old = copy.deepcopy(model).double()  # before the engine fuses the model's projections
    batch = prompt_batch(tokenizer)
    params = {"temperature": 0.0, "max_new_tokens": 14, "ignore_eos": True}
    engine = engine_for(loaded)
    engine.keep_kv_on_update = True
    _interrupt_after(engine, 4)
    partial = engine.generate(batch, params)
    engine._decode = NativeEngine._decode.__get__(engine)
    gen = torch.Generator().manual_seed(3)
    new_weights = {n: p + 0.3 * torch.randn(p.shape, generator=gen) for n, p in old.named_parameters()}
    engine.update_weights({n: w.float() for n, w in new_weights.items()}, 2)
    engine.resume()
    prefilled = _count_prefill_rows(engine)
    done = engine.generate(partial, params)
    assert prefilled["rows"] == 0 and engine.kept_slots["reclaimed"] == engine.kept_slots["across_updates"] == len(batch)
    assert done.meta_info["weight_version"] == 2
    new = copy.deepcopy(old)
    new.load_state_dict(new_weights, strict=False)
    kept = partial.batch["response_mask"].sum(1)
    for row in range(len(batch)):
        prompt = batch.batch["input_ids"][row][batch.batch["attention_mask"][row].bool()]
        response = done.batch["responses"][row][done.batch["response_mask"][row].bool()]
        k = int(kept[row])
        with torch.no_grad():
            cache = old(torch.cat([prompt, response[: k - 1]])[None], use_cache=True).past_key_values
            ids, want = response[k - 1 : k], []
            for j in range(k, len(response)):
                out = new(ids[None], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1], -1)
                assert int(logp.argmax()) == int(response[j]), (row, j)  # greedy: the reference's choice
                want.append(float(logp[response[j]]))
                ids = response[j : j + 1]
        got = done.batch["rollout_log_probs"][row][k : len(response)]
        torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-4)
    mask = partial.batch["response_mask"].bool()  # the old tokens' log-probs are kept as generated
    assert torch.equal(done.batch["rollout_log_probs"][mask], partial.batch["rollout_log_probs"][mask])


def test_kept_kv_is_freed_at_an_update_that_recalibrates_fp8_kv_scales(loaded):
    """An FP8 KV cache whose scales follow each update would read the kept codes at new scales: freed instead."""
    model, tokenizer = loaded
    engine = engine_for(loaded, kv_cache_dtype="fp8")
    engine.keep_kv_on_update = True
    _interrupt_after(engine, 3)
    partial = engine.generate(prompt_batch(tokenizer), {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    engine._decode = NativeEngine._decode.__get__(engine)
    engine.update_weights({n: p.detach().clone() for n, p in model.named_parameters()}, 1)
    assert engine.kept_slots["freed"] == len(partial) and engine.cache.recalibrate
    engine.kv_scale_recalibration = False
    _interrupt_after(engine, 3)
    engine.resume()
    engine.generate(prompt_batch(tokenizer), {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    engine._decode = NativeEngine._decode.__get__(engine)
    engine.update_weights({n: p.detach().clone() for n, p in model.named_parameters()}, 2)
    assert engine.kept_slots["freed"] == len(partial)  # scales kept: so are the rows' caches


def test_interrupt_from_another_thread(loaded):
    tokenizer = loaded[1]
    engine = engine_for(loaded, max_seq_len=256)
    started = threading.Event()
    original = engine._decode

    def slow_decode(*args, **kwargs):
        started.set()
        original(*args, **kwargs)

    engine._decode = slow_decode
    timer = threading.Thread(target=lambda: (started.wait(5), engine.interrupt()))
    timer.start()
    out = engine.generate(prompt_batch(tokenizer), {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True})
    timer.join()
    assert out.meta_info["interrupted"] is True
    assert out.batch["response_mask"].sum(1).max() < 200


def test_from_config(qwen3_dir):
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.policy.model_name = str(qwen3_dir)
    config.policy.max_prompt_length = 20
    config.policy.rollout.max_new_tokens = 8
    config.policy.rollout.max_batch_size = 4
    config.cluster.device = "cpu"
    engine = NativeEngine.from_config(config)
    assert engine.max_seq_len == 28 and engine.max_batch_size == 4
    assert engine.model.dtype == torch.float32
    out = engine.generate(prompt_batch(engine.tokenizer), config.policy.rollout)
    assert out.batch["responses"].shape == (len(PROMPTS), 8)
    assert NativeEngine.probe() is None and "interrupt_resume" in NativeEngine.capabilities
    assert engine.kernels.decode_linear == "auto" and engine.kernels.pdl is True  # the config's defaults
    config.policy.rollout.decode_linear, config.policy.rollout.pdl = "off", False
    engine = NativeEngine.from_config(config)
    assert engine.kernels.decode_linear == "off" and engine.kernels.pdl is False  # read, not ignored


def test_kv_block_is_read_and_keys_the_decode_lengths(qwen3_dir):
    """``policy.rollout.kv_block``: decode attends to a multiple of that many columns (one graph per length on
    CUDA); more masked columns change neither the greedy tokens nor, beyond float32 summation, the log-probs. A bad
    value is refused naming it."""
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.policy.model_name = str(qwen3_dir)
    config.policy.max_prompt_length, config.policy.rollout.max_new_tokens = 40, 8
    config.policy.rollout.max_batch_size, config.cluster.device = 4, "cpu"
    exact = NativeEngine.from_config(config)
    assert exact.kv_block == 1  # CPU default: exact lengths
    config.policy.rollout.kv_block = 16
    blocked = NativeEngine.from_config(config)
    assert blocked.kv_block == 16
    keys = []
    step = blocked._decode_step
    blocked.graphs.step = lambda *key: keys.append(key) or step(*key)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    a, b = (engine.generate(prompt_batch(engine.tokenizer), params) for engine in (exact, blocked))
    assert keys and all(kv_len % 16 == 0 for _, kv_len, _ in keys), keys  # (bucket, kv_len, mode); 48 columns
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5)
    for bad in (0, -64, 2.5):
        with pytest.raises(ValueError, match=f"kv_block={bad!r}"):
            NativeEngine(exact.model, exact.tokenizer, kv_block=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_generation_matches_training_forward(qwen3_dir):
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="bfloat16", device="cuda")
    engine = NativeEngine(model, tokenizer, device="cuda", max_batch_size=8, max_seq_len=64)
    out = engine.generate(prompt_batch(tokenizer), {"temperature": 1.0, "max_new_tokens": 16, "seed": 3})
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"].cuda(), attention_mask=out.batch["attention_mask"].cuda()).logits
    width = out.batch["prompts"].shape[1]
    reference = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(
        2, out.batch["responses"].cuda()[..., None]
    ).squeeze(-1).cpu()
    mask = out.batch["response_mask"].bool()
    assert (reference - out.batch["rollout_log_probs"])[mask].abs().mean() < 2e-2  # bf16 kernels differ
