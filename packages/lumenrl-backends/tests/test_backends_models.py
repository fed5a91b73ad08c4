"""Char tokenizer, tiny configs, built-in lumenrl: models (atomic cache build) and the loader."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from lumenrl_backends.models import (
    FAMILIES,
    build_char_tokenizer,
    build_tiny_model,
    builtin_key,
    builtin_names,
    load_model_and_tokenizer,
    model_cache_dir,
    resolve_dtype,
    resolve_model_path,
    tiny_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU


def test_char_tokenizer_round_trip_and_specials(tmp_path):
    tokenizer = build_char_tokenizer()
    text = "what is (12+34)*5 - 6/2? answer: 0.5, #### 42!"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no added specials
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id == 0 and tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.decode([1, *ids, 2], skip_special_tokens=True) == text
    assert tokenizer("A~")["input_ids"] == [tokenizer.unk_token_id] * 2  # outside the vocabulary
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded(text)["input_ids"] == ids and reloaded.padding_side == "left"
    batch = reloaded(["1+1=", "12+34="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]


def test_chat_template():
    tokenizer = build_char_tokenizer()
    messages = [{"role": "user", "content": "1+1="}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos>user: 1+1=\nassistant: "
    dialogue = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "2"}], tokenize=False)
    assert dialogue == "<bos>user: 1+1=\nassistant: 2<eos>\n"
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids, skip_special_tokens=True) == prompt[5:]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_every_family(family):
    config = tiny_config(family)
    assert config.model_type == family
    assert config.vocab_size == len(build_char_tokenizer())
    assert config.hidden_size == 64 and 2 <= config.num_hidden_layers <= 4
    assert tiny_config(family, num_hidden_layers=3).num_hidden_layers == 3


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="family='gpt9'.*llama"):
        tiny_config("gpt9")


def test_build_tiny_model_is_seeded_and_saved(tmp_path):
    a = build_tiny_model("llama", tmp_path / "a", seed=3)
    b = build_tiny_model("llama", tmp_path / "b", seed=3)
    state = torch.random.get_rng_state()
    c = build_tiny_model("llama", tmp_path / "c", seed=4)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    models = [load_model_and_tokenizer(str(p))[0] for p in (a, b, c)]
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in models)
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert AutoConfig.from_pretrained(a, local_files_only=True).model_type == "llama"


def test_builtin_arith_model_is_built_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a built-in must never need the network
    assert model_cache_dir() == tmp_path / "cache"
    path = resolve_model_path("lumenrl:tiny-qwen3-arith")
    key = builtin_key("tiny-qwen3-arith")  # hashes the settings and the building code
    assert path == str(tmp_path / "cache" / "tiny-qwen3-arith" / key)
    assert sorted(os.listdir(tmp_path / "cache" / "tiny-qwen3-arith")) == [key]  # no staging leftovers
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert resolve_model_path("lumenrl:tiny-qwen3-arith") == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp  # not rebuilt
    model, tokenizer = load_model_and_tokenizer("lumenrl:tiny-qwen3-arith")
    config = model.config
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (2, 384, 256)
    params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= params <= 2_000_000
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tokenizer.chat_template and tokenizer.padding_side == "left"
    assert not model.training


def test_every_builtin_name_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path))
    names = builtin_names()
    assert "lumenrl:tiny-qwen3-arith" in names
    assert {f"lumenrl:tiny-{family}" for family in FAMILIES} <= set(names)
    from lumenrl_core.builtins import BUILTIN_MODELS  # what config checks accept, torch-free

    assert set(names) == {f"lumenrl:{n}" for n in BUILTIN_MODELS}
    path = resolve_model_path("lumenrl:tiny-mixtral")
    assert AutoConfig.from_pretrained(path, local_files_only=True).model_type == "mixtral"


def test_non_builtin_names_pass_through_and_bad_names_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path))
    assert resolve_model_path("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert resolve_model_path("/some/local/dir") == "/some/local/dir"
    with pytest.raises(ValueError, match="lumenrl:tiny-nope.*lumenrl:tiny-qwen3-arith"):
        resolve_model_path("lumenrl:tiny-nope")


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype='fp9'"):
        resolve_dtype("fp9", "cpu")


def test_tiny_config_override_by_an_alias_wins_over_the_family_default():
    """qwen3_moe's num_experts is an alias of num_local_experts (the family default): the caller's value holds."""
    from lumenrl_backends.models.tiny import tiny_config

    assert tiny_config("qwen3_moe", num_experts=8).num_experts == 8
    assert tiny_config("qwen3_moe", num_local_experts=6).num_experts == 6
    assert tiny_config("qwen3_moe").num_experts == 4
