"""Shared prefill (``share_prefill``): rows of one context admitted together run one prefill, the others take a copy
of its cache columns and last logits. The copy itself (rows and V tiles, FP8 codes), bitwise agreement with a prefill
per row under the exact (batch-invariant) mode, agreement with the training forward, and where it is off."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.engines.kv_cache import CacheView, SlotKVCache
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

FP8 = torch.float8_e4m3fn
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it"]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 10, "seed": 3, "ignore_eos": True}


def group_batch(tokenizer, prompts=PROMPTS, n: int = 4) -> DataProto:
    """Each prompt ``n`` times in a row (a GRPO group), plus one prompt alone at the end."""
    rows = [p for p in prompts for _ in range(n)] + ["9"]
    enc = tokenizer(rows, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize(("fp8", "tile"), [(False, 0), (True, 0), (False, 4), (True, 4)])
def test_copy_slots_copies_the_stored_columns_and_their_validity(fp8, tile):
    """Slots 3 and 0 take slot 1's first 6 columns (V in rows or in tiles of 4, FP8 codes or 16-bit values): the
    same stored bits and validity; a target's columns past the width are invalid, whatever they held before."""
    gen = torch.Generator().manual_seed(5)
    cache = SlotKVCache(num_layers=2, max_slots=4, max_len=12, device=torch.device("cpu"),
                        kv_dtype=FP8 if fp8 else None, v_tile=tile)
    width, rows = 6, torch.arange(4)
    cache.set_view(CacheView(rows=rows, columns=torch.arange(10).expand(4, 10), decode=False, kv_len=10))
    for layer in range(2):
        cache.update(torch.randn(4, 2, 10, 8, generator=gen), torch.randn(4, 2, 10, 8, generator=gen), layer)
    cache.valid[:, :10] = True
    cache.valid[1, :2] = False  # slot 1: two columns of left padding
    cache.copy_slots(torch.tensor([1, 1]), torch.tensor([3, 0]), width)
    for target in (3, 0):
        assert torch.equal(cache.valid[target, :width], cache.valid[1, :width])
        assert not cache.valid[target, width:].any()
        for layer in cache.layers:
            assert torch.equal(as_bits(layer.keys[target, :, :width]), as_bits(layer.keys[1, :, :width]))
            values = layer.values[:, :, : -(-width // tile)] if tile else layer.values[:, :, :width]
            assert torch.equal(as_bits(values[target]), as_bits(values[1]))
    assert cache.valid[2, :10].all()  # other slots untouched


def test_group_rows_prefill_once_and_generate_what_a_prefill_per_row_does(qwen3_dir):
    """Exact mode (each row's result independent of its batch): 3 groups of 4 plus a lone prompt prefill 4 rows;
    the other 9 copy. Tokens and log-probs equal, bit for bit, what 13 separate prefills give; the rows of a
    group differ (their own seeds)."""
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    engine = NativeEngine(model, tokenizer, max_batch_size=16, max_seq_len=64, exact_logprobs=True)
    assert engine.share_prefill
    batch = group_batch(tokenizer)
    shared = engine.generate(batch, SAMPLED)
    assert engine.prefill_rows == {"prefilled": 4, "shared": 9}
    engine.share_prefill = False
    separate = engine.generate(batch, SAMPLED)
    assert engine.prefill_rows == {"prefilled": 4 + 13, "shared": 9}
    assert torch.equal(shared.batch["responses"], separate.batch["responses"])
    assert torch.equal(shared.batch["rollout_log_probs"], separate.batch["rollout_log_probs"])
    group = shared.batch["responses"][:4].tolist()
    assert len({tuple(r) for r in group}) == 4


def test_shared_rows_match_the_training_forward_under_continuous_batching(qwen3_dir):
    """Default kernels, 8 slots for 13 rows: the first admission shares within the groups it holds, the rows
    admitted as slots free up share among themselves; every row's log-probs are the training forward's."""
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    engine = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    batch = group_batch(tokenizer)
    out = engine.generate(batch, {**SAMPLED, "ignore_eos": False, "max_new_tokens": 12})
    counts = engine.prefill_rows
    assert counts["prefilled"] + counts["shared"] == 13 and counts["shared"] >= 6
    mask = out.batch["response_mask"].bool()
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    expected = torch.log_softmax(logits[:, width - 1 : -1].double(), dim=-1).gather(
        2, out.batch["responses"][..., None]).squeeze(-1)
    delta = (expected - out.batch["rollout_log_probs"].double())[mask]
    assert mask.sum() > 60
    assert delta.abs().max() < 1e-3, delta.abs().max()


def test_engine_stats_count_the_prefills(qwen3_dir):
    """What the rollouter reports of its engine (``engine_stats``): rows prefilled and shared, and the prefills that
    ran at their own shape (all of them off CUDA: no graphs), with their host seconds."""
    from lumenrl_backends.trainers.rollouter import engine_stats

    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    engine = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    engine.generate(group_batch(tokenizer), {**SAMPLED, "max_new_tokens": 3})  # 13 rows, 8 slots: two admissions
    stats = engine_stats(engine)
    assert stats["prefill_rows"] + stats["shared_prefill_rows"] == 13 and stats["shared_prefill_rows"] >= 6
    assert stats["prefill_eager"] >= 2 and stats["prefill_eager_s"] > 0
    assert stats["prefill_packed"] == 0  # pack_prefill=auto: only where the varlen kernel runs (CUDA)
    assert stats["graph_captures"] == stats["graph_recorded"] == 0 and 0 < stats["prefill_wait_s"] < 60


def test_continued_rows_with_distinct_responses_prefill_each():
    """A continuation (prompt ++ partial response) shares only with a row of the same context: the rows of an
    interrupted group hold different responses, so each prefills."""
    from lumenrl_backends.engines.requests import Request, group_by_context

    rows = [Request(index=i, prompt=[5, 6, 7], seed=i, response=list(r)) for i, r in
            enumerate([[1], [2], [1], [], []])]
    leads, copies = group_by_context(rows)
    assert [r.index for r in leads] == [0, 1, 3]
    by_index = {id(r): r.index for r in rows}
    assert {by_index[key]: [r.index for r in rest] for key, rest in copies.items()} == {0: [2], 3: [4]}


def test_share_prefill_is_read_from_the_config(qwen3_dir):
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.policy.model_name = str(qwen3_dir)
    config.policy.max_prompt_length, config.policy.rollout.max_new_tokens = 20, 4
    config.policy.rollout.max_batch_size, config.cluster.device = 4, "cpu"
    assert NativeEngine.from_config(config).share_prefill is True
    config.policy.rollout.share_prefill = False
    assert NativeEngine.from_config(config).share_prefill is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shared_rows_from_a_graphed_prefill_match_the_training_forward(qwen3_dir):
    """CUDA, bf16: the leads' prefill replays a captured graph (its logits a graph output) and the copies take
    theirs from it; every row's log-probs are the training forward's within bf16's bound, as unshared rows' are."""
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="bfloat16", device="cuda")
    engine = NativeEngine(model, tokenizer, device="cuda", max_batch_size=16, max_seq_len=64)
    batch = group_batch(tokenizer)
    errors = []
    for share in (True, False):
        engine.share_prefill = share
        out = engine.generate(batch, {**SAMPLED, "max_new_tokens": 16})
        with torch.no_grad():
            logits = model(input_ids=out.batch["input_ids"].cuda(),
                           attention_mask=out.batch["attention_mask"].cuda()).logits
        width = out.batch["prompts"].shape[1]
        reference = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(
            2, out.batch["responses"].cuda()[..., None]).squeeze(-1).cpu()
        mask = out.batch["response_mask"].bool()
        errors.append((reference - out.batch["rollout_log_probs"])[mask].abs().mean().item())
    assert engine.prefill_rows["shared"] == 9 and engine.prefill._inputs  # a graphed prefill ran
    assert errors[0] < 2e-2 and errors[1] < 2e-2, errors
