"""The model cache: keys hash the building code, corrupt or stale entries are rebuilt, staging dirs cleaned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

from lumenrl_backends.models import builtin, cache, load_model_and_tokenizer, resolve_model_path


def _module(tmp_path, name: str, source: str) -> types.ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    return module


def test_key_changes_when_the_building_code_changes(tmp_path):
    module = _module(tmp_path, "builder", "def build():\n    return 1\n")
    first = cache.artifact_key({"seed": 0}, [module])
    assert cache.artifact_key({"seed": 0}, [module]) == first  # deterministic
    assert cache.artifact_key({"seed": 1}, [module]) != first  # settings
    (tmp_path / "builder.py").write_text("def build():\n    return 2\n")
    assert cache.artifact_key({"seed": 0}, [module]) != first  # code


def test_builtin_key_hashes_its_builders(monkeypatch):
    key = builtin.builtin_key("tiny-qwen3")
    assert key != builtin.builtin_key("tiny-llama")
    monkeypatch.setattr(cache, "source_hash", lambda modules: "changed code")
    assert builtin.builtin_key("tiny-qwen3") != key


def test_corrupt_entries_are_rebuilt_never_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path))
    path = resolve_model_path("lumenrl:tiny-qwen3")
    target = tmp_path / "tiny-qwen3" / builtin.builtin_key("tiny-qwen3")
    assert path == str(target) and cache.entry_is_valid(target, target.name)
    (weights,) = target.glob("*.safetensors")
    good = weights.read_bytes()
    corruptions = [
        lambda: weights.write_bytes(good[: len(good) // 2]),  # truncated weights
        lambda: (target / "config.json").write_text("{not json"),  # bad config
        lambda: weights.unlink(),  # missing weights
        lambda: (target / cache.MANIFEST).write_text(json.dumps({"key": "stale"})),  # another build's key
    ]
    for corrupt in corruptions:
        corrupt()
        assert not cache.entry_is_valid(target, target.name)
        assert resolve_model_path("lumenrl:tiny-qwen3") == str(target)
        assert cache.entry_is_valid(target, target.name)
        model, _ = load_model_and_tokenizer("lumenrl:tiny-qwen3")  # loads again
        assert sum(p.numel() for p in model.parameters()) > 0


def test_interrupted_builds_leave_no_staging_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path))
    parent = tmp_path / "tiny-qwen3"
    key = builtin.builtin_key("tiny-qwen3")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = parent / f".{key}.{int(dead.stdout)}.abcd"  # a build whose process is gone
    live = parent / f".{key}.{os.getpid()}.efgh"  # a build in progress (this process)
    for path in (stale, live):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    resolve_model_path("lumenrl:tiny-qwen3")
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in parent.iterdir()) == sorted([key, live.name])
