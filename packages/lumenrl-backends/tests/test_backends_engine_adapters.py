"""Adapter probes: a missing library, and a namesake package without the expected API, are both
reported with a reason (the adapters' generate paths need the real libraries and GPUs: untested)."""

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
