"""Every supported family's tiny config loads from a save_pretrained directory and generates with
the native and hf engines; native greedy equals HF greedy and native log-probs equal the
training forward's. Also sliding-window attention (all layers, and mixed layer types)."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.engines.hf import HFEngine
from lumenrl_backends.models import FAMILIES, load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9"]
NEW = 10


def prompt_batch(tokenizer) -> DataProto:
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def forward_log_probs(model, out: DataProto) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    return torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(2, out.batch["responses"][..., None]).squeeze(-1)


def check_engines(path) -> None:
    model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32")
    batch = prompt_batch(tokenizer)
    greedy = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    native = NativeEngine(model, tokenizer, max_batch_size=4, max_seq_len=48).generate(batch, greedy)
    hf = HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=48).generate(batch, greedy)
    assert native.batch["responses"].shape == (len(PROMPTS), NEW)
    assert torch.equal(native.batch["responses"], hf.batch["responses"])
    assert (native.batch["rollout_log_probs"] - hf.batch["rollout_log_probs"]).abs().max() < 1e-4
    mask = native.batch["response_mask"].bool()
    assert (forward_log_probs(model, native) - native.batch["rollout_log_probs"])[mask].abs().mean() < 1e-4
    sampled = NativeEngine(model, tokenizer, max_batch_size=4, max_seq_len=48).generate(
        batch, {"temperature": 1.0, "max_new_tokens": NEW, "seed": 1}
    )
    mask = sampled.batch["response_mask"].bool()
    assert (forward_log_probs(model, sampled) - sampled.batch["rollout_log_probs"])[mask].abs().mean() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(family, tiny_model_dir):
    path = tiny_model_dir(family, initializer_range=0.2)
    check_engines(path)


def test_sliding_window_all_layers(tiny_model_dir):
    path = tiny_model_dir("mixtral", initializer_range=0.2, sliding_window=5)
    check_engines(path)


def test_sliding_window_mixed_layer_types(tiny_model_dir):
    path = tiny_model_dir("qwen3", initializer_range=0.2, use_sliding_window=True,
                          sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    model, _ = load_model_and_tokenizer(str(path))
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    check_engines(path)
