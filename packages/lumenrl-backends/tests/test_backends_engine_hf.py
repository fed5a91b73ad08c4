"""HFEngine (transformers.generate): layout, log-prob convention, stops, seeds, weights, interrupt."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines.hf import HFEngine
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "100-1="]


@pytest.fixture()
def loaded(llama_dir):
    return load_model_and_tokenizer(str(llama_dir), dtype="float32")


def prompt_batch(tokenizer) -> DataProto:
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def forward_log_probs(model, out: DataProto, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    logits = logits[:, width - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(2, out.batch["responses"][..., None]).squeeze(-1)


def test_sampled_log_probs_follow_the_convention(loaded):
    model, tokenizer = loaded
    engine = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64)  # 3 chunks
    out = engine.generate(prompt_batch(tokenizer), {"temperature": 0.7, "top_k": 8, "max_new_tokens": 16, "seed": 3})
    mask = out.batch["response_mask"].bool()
    assert out.batch["responses"].shape == (len(PROMPTS), 16) and mask.sum() > 10
    delta = (forward_log_probs(model, out, 0.7) - out.batch["rollout_log_probs"])[mask]
    assert delta.abs().mean() < 1e-4
    for row in range(len(PROMPTS)):  # masks are a prefix; EOS only at the end of a "stop" row
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        tokens = out.batch["responses"][row, :n].tolist()
        assert tokenizer.eos_token_id not in tokens[:-1]
        assert (out.non_tensor_batch["finish_reason"][row] == "stop") == (tokens[-1] == tokenizer.eos_token_id)
    again = engine.generate(prompt_batch(tokenizer), {"temperature": 0.7, "top_k": 8, "max_new_tokens": 16, "seed": 3})
    assert torch.equal(out.batch["responses"], again.batch["responses"])


def test_stop_tokens_and_ignore_eos(loaded):
    model, tokenizer = loaded
    engine = HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    free = engine.generate(prompt_batch(tokenizer), {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
    assert (free.batch["response_mask"].sum(1) == 12).all()
    stop = int(free.batch["responses"][1, 2])
    out = engine.generate(prompt_batch(tokenizer),
                          {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [stop]})
    for row in range(len(PROMPTS)):
        full = free.batch["responses"][row].tolist()
        n = full.index(stop) + 1 if stop in full else 12
        assert out.batch["responses"][row, :n].tolist() == full[:n]
        assert int(out.batch["response_mask"][row].sum()) == n


def test_update_weights_in_place(loaded):
    model, tokenizer = loaded
    engine = HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    before = engine.generate(prompt_batch(tokenizer), params)
    pointers = [p.data_ptr() for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    engine.update_weights({n: p + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}, 2)
    assert [p.data_ptr() for p in model.parameters()] == pointers and engine.weight_version == 2
    after = engine.generate(prompt_batch(tokenizer), params)
    assert not torch.equal(before.batch["responses"], after.batch["responses"])


def test_interrupt_and_continue(loaded):
    model, tokenizer = loaded
    engine = HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    full = engine.generate(prompt_batch(tokenizer), params)
    engine.interrupt()
    partial = engine.generate(prompt_batch(tokenizer), params)
    assert partial.meta_info["interrupted"] is True
    assert set(partial.non_tensor_batch["finish_reason"]) == {"interrupted"}
    engine.resume()
    done = engine.generate(partial, params)
    assert done.meta_info["interrupted"] is False
    assert torch.equal(done.batch["responses"], full.batch["responses"])  # greedy: continuation is exact


def test_generate_names_rows_without_a_prompt_token(loaded):
    model, tokenizer = loaded
    batch = prompt_batch(tokenizer)
    batch.batch["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have an all-zero attention_mask"):
        HFEngine(model, tokenizer).generate(batch, {"max_new_tokens": 2})


def test_from_config_reads_sizes_and_device(loaded):
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.policy.max_prompt_length = 20
    config.policy.rollout.max_new_tokens = 4
    config.policy.rollout.max_batch_size = 3
    config.cluster.device = "cpu"
    model, tokenizer = loaded
    engine = HFEngine.from_config(config, model=model, tokenizer=tokenizer)
    assert engine.max_seq_len == 24 and engine.max_batch_size == 3 and engine.device.type == "cpu"
    out = engine.generate(prompt_batch(tokenizer), config.policy.rollout)
    assert out.batch["responses"].shape == (len(PROMPTS), 4)
