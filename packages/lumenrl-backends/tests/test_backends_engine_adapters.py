"""Adapter probes: a missing library, and a namesake package without the expected API, are both
reported with a reason. The libraries themselves need GPUs (not installed here): fakes record what the
adapters pass their engine constructors and sampling parameters (the policy/rollout keys), and what the
adapters make of the results (ATOM: responses cut at stop_token_ids)."""

from __future__ import annotations

import sys

import pytest

from lumenrl_backends.engines.adapters import AtomEngine, SGLangEngine, VLLMEngine, probe_module


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    def make(name: str, body: str = "", subpackages: tuple[str, ...] = ()) -> None:
        root = tmp_path / name
        root.mkdir()
        (root / "__init__.py").write_text(body)
        for sub in subpackages:
            (root / sub).mkdir()
            (root / sub / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)

    return make


@pytest.mark.parametrize("engine", [VLLMEngine, SGLangEngine, AtomEngine])
def test_missing_library_is_reported(engine, monkeypatch):
    for name in ("vllm", "sglang", "atom"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    reason = engine.probe()
    assert reason and ("not installed" in reason or "fails to import" in reason)


def test_namesake_atom_is_rejected(fake_package):
    fake_package("atom", "def parse(s):\n    return s\n")  # PyPI's unrelated `atom`
    reason = AtomEngine.probe()
    assert reason and "LLMEngine" in reason and "not the expected library" in reason


def test_atom_with_api_but_no_model_engine_is_rejected(fake_package):
    fake_package("atom", "class LLMEngine: ...\nclass SamplingParams: ...\n")
    assert "atom.model_engine" in AtomEngine.probe()


def test_real_looking_atom_passes_probe(fake_package):
    fake_package("atom", "class LLMEngine: ...\nclass SamplingParams: ...\n", subpackages=("model_engine",))
    assert AtomEngine.probe() is None


def test_vllm_without_api_is_rejected(fake_package):
    fake_package("vllm", "VERSION = '0'\n")
    reason = VLLMEngine.probe()
    assert "LLM" in reason and "SamplingParams" in reason


def test_broken_import_is_reported(fake_package):
    fake_package("sglang", "raise RuntimeError('no GPU runtime')\n")
    assert "RuntimeError: no GPU runtime" in SGLangEngine.probe()


def test_probe_module_ok():
    assert probe_module("json", ("dumps", "loads"), "stdlib") is None


def test_capabilities_are_honest():
    assert "interrupt_resume" not in VLLMEngine.capabilities | SGLangEngine.capabilities | AtomEngine.capabilities
    assert "logprobs" not in AtomEngine.capabilities


# ---------------------------------------------------------------- what the adapters pass the libraries (fakes)


class _Tokenizer:
    pad_token_id = 0

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in sequences]


def _run_config(**policy):
    """The keys the adapters read (a namespace: the config loader would look for the model directories)."""
    from types import SimpleNamespace as NS

    rollout = NS(max_batch_size=24, gpu_memory_utilization=0.3, max_new_tokens=8, tensor_parallel_size=2)
    fields = {"model_name": "/models/m", "tokenizer_name": "/tokenizers/t", "dtype": "bfloat16",
              "trust_remote_code": True, "max_prompt_length": 16, "rollout": rollout, **policy}
    return NS(policy=NS(**fields))


def _batch():
    import torch

    from lumenrl_core.data_proto import DataProto

    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": (ids != 0).long()})


SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 8, "stop_token_ids": [42],
            "ignore_eos": True, "seed": 5}


def _tokenizer_loader(seen, tokenizer):
    def load(path, trust_remote_code=False):
        seen["tok"] = (path, trust_remote_code)
        return tokenizer

    return load


def _module(name, monkeypatch, **attrs):
    import types

    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_vllm_gets_model_tokenizer_dtype_and_batch_keys(monkeypatch):
    import types

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs

        def get_tokenizer(self):
            return _Tokenizer()

        def generate(self, prompts, sp, use_tqdm=False):  # one reply per prompt, in the prompts' order
            seen.setdefault("calls", []).append((prompts, sp))
            replies = []
            for prompt in prompts:
                last = prompt["prompt_token_ids"][-1]  # the reply tells which prompt it answers
                steps = [{last: types.SimpleNamespace(logprob=-0.5)}, {42: types.SimpleNamespace(logprob=-0.25)}]
                out = types.SimpleNamespace(token_ids=[last, 42], logprobs=steps, finish_reason="stop")
                replies.append(types.SimpleNamespace(outputs=[out]))
            return replies

    def sampling_params(**kwargs):
        seen.setdefault("sampling", []).append(kwargs)
        return kwargs

    _module("vllm", monkeypatch, LLM=LLM, SamplingParams=sampling_params)
    engine = VLLMEngine.from_config(_run_config())
    assert seen["llm"] == {"model": "/models/m", "tokenizer": "/tokenizers/t", "dtype": "bfloat16",
                           "trust_remote_code": True, "max_num_seqs": 24, "gpu_memory_utilization": 0.3,
                           "max_model_len": 24, "tensor_parallel_size": 2, "logprobs_mode": "processed_logprobs"}
    out = engine.generate(_batch(), SAMPLING)
    (prompts, per_row), = seen["calls"]  # the whole batch in one call: vLLM batches the rows itself
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}]
    assert per_row == seen["sampling"]
    assert seen["sampling"][1] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 8,
                                   "stop_token_ids": [42], "ignore_eos": True, "logprobs": 0, "seed": 6}
    assert list(out.non_tensor_batch["finish_reason"]) == ["stop", "stop"]
    responses = out.batch["responses"]
    assert responses[:, :2].tolist() == [[6, 42], [9, 42]]  # each row its own prompt's reply
    assert out.batch["rollout_log_probs"][:, :2].tolist() == [[-0.5, -0.25], [-0.5, -0.25]]
    VLLMEngine.from_config(_run_config(tokenizer_name="", dtype="auto", trust_remote_code=False))
    assert (seen["llm"]["tokenizer"], seen["llm"]["dtype"], seen["llm"]["trust_remote_code"]) == ("/models/m", "auto",
                                                                                                   False)


def test_sglang_gets_model_tokenizer_dtype_and_batch_keys(monkeypatch):
    from lumenrl_backends.engines import adapters

    seen = {}

    class Engine:
        def __init__(self, **kwargs):
            seen["engine"] = kwargs

        def generate(self, input_ids, sampling_params, return_logprob):
            seen["sampling"] = sampling_params
            return [{"meta_info": {"output_token_logprobs": [(-0.5, 3, None)], "finish_reason": {"type": "length"}}}
                    for _ in input_ids]

    _module("sglang", monkeypatch, Engine=Engine)
    monkeypatch.setattr(adapters, "_load_tokenizer", _tokenizer_loader(seen, _Tokenizer()))
    engine = SGLangEngine.from_config(_run_config())
    assert seen["engine"] == {"model_path": "/models/m", "tokenizer_path": "/tokenizers/t", "dtype": "bfloat16",
                              "trust_remote_code": True, "max_running_requests": 24, "mem_fraction_static": 0.3,
                              "tp_size": 2}
    assert seen["tok"] == ("/tokenizers/t", True)  # the adapter's own tokenizer is the engine's
    engine.generate(_batch(), SAMPLING)
    assert seen["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 8,
                                "stop_token_ids": [42], "ignore_eos": True}


def _fake_atom(monkeypatch, seen, config_fields=("model", "trust_remote_code", "max_num_seqs",
                                                 "gpu_memory_utilization"), takes_tokenizer=True):
    import dataclasses

    class LLMEngine:
        def __init__(self, model, tokenizer=None, **kwargs):
            seen["engine"] = {"model": model, "tokenizer": tokenizer, **kwargs}
            self.tokenizer = tokenizer or _Tokenizer()

        def generate(self, prompts, sp):
            seen["sampling"] = sp
            return [{"token_ids": [3, 42, 4], "finish_reason": "max_tokens"},
                    {"token_ids": [3, 4], "finish_reason": "stop_7"}]

    class OldLLMEngine(LLMEngine):  # before 2026-03: no tokenizer argument
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)

    def sampling_params(**kwargs):
        return kwargs

    config = dataclasses.make_dataclass("Config", list(config_fields))
    atom = _module("atom", monkeypatch, LLMEngine=LLMEngine if takes_tokenizer else OldLLMEngine,
                   SamplingParams=sampling_params)
    atom.config = _module("atom.config", monkeypatch, Config=config)


def test_atom_gets_tokenizer_batch_memory_and_sampling_keys(monkeypatch):
    from lumenrl_backends.engines import adapters

    seen = {}
    _fake_atom(monkeypatch, seen)
    tokenizer = _Tokenizer()
    monkeypatch.setattr(adapters, "_load_tokenizer", _tokenizer_loader(seen, tokenizer))
    engine = AtomEngine.from_config(_run_config())
    assert seen["engine"] == {"model": "/models/m", "tokenizer": tokenizer, "trust_remote_code": True,
                              "max_num_seqs": 24, "gpu_memory_utilization": 0.3}
    assert seen["tok"] == ("/tokenizers/t", True)
    out = engine.generate(_batch(), SAMPLING)
    assert seen["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 8, "ignore_eos": True}
    assert out.batch["responses"][0].tolist()[:3] == [3, 42, 0]  # cut after the stop token 42
    assert out.batch["response_mask"][0].tolist()[:3] == [1, 1, 0]
    assert list(out.non_tensor_batch["finish_reason"]) == ["stop", "stop"]  # ATOM's stop_<id>: a stop
    AtomEngine.from_config(_run_config(tokenizer_name="", trust_remote_code=False))  # ATOM's defaults: not passed
    assert seen["engine"] == {"model": "/models/m", "tokenizer": None, "max_num_seqs": 24,
                              "gpu_memory_utilization": 0.3}


def test_atom_that_would_drop_a_key_is_refused(monkeypatch):
    from lumenrl_backends.engines import adapters

    seen = {}
    monkeypatch.setattr(adapters, "_load_tokenizer", _tokenizer_loader(seen, _Tokenizer()))
    _fake_atom(monkeypatch, seen, config_fields=("model", "max_num_seqs", "gpu_memory_utilization"),
               takes_tokenizer=False)  # an ATOM before trust_remote_code and tokenizer
    with pytest.raises(ValueError, match=r"\['tokenizer', 'trust_remote_code'\]"):
        AtomEngine.from_config(_run_config())
    assert "engine" not in seen
