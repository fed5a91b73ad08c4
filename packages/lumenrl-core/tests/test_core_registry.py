"""Plugin registry: discovery, duplicates, unknown names, lazy loading, version checks, probes."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys

import pytest
import torch

from lumenrl_core.plugins import (
    KINDS,
    KNOWN_PROVIDERS,
    DuplicatePluginError,
    PluginLoadError,
    PluginRegistry,
    PluginSpec,
    UnknownPluginError,
    core_requirement_problem,
    core_version,
    cuda_probe,
    first_reason,
    get_registry,
    group_of,
    module_installed,
    module_probe,
    set_registry,
    sibling_requirement_problems,
)


class GoodEngine:
    capabilities = frozenset({"fp8_weights", "logprobs"})

    @classmethod
    def probe(cls):
        return None


class NoGpuEngine:
    capabilities = frozenset({"logprobs"})

    @classmethod
    def probe(cls):
        return "no CUDA/ROCm GPU visible to torch"


class CrashingProbe:
    capabilities = frozenset()

    @classmethod
    def probe(cls):
        raise RuntimeError("driver exploded")


@pytest.fixture
def reg() -> PluginRegistry:
    return PluginRegistry(discover=False)


def test_kinds_and_groups():
    assert len(KINDS) == 14 and "rollout_engines" in KINDS
    assert group_of("quant_schemes") == "lumenrl.quant_schemes"
    with pytest.raises(ValueError, match=r"kind='rollout_engine'.*did you mean 'rollout_engines'"):
        group_of("rollout_engine")


def test_register_load_info(reg):
    reg.register("rollout_engines", "good", GoodEngine, distribution="lumenrl-test", version="1.2.3")
    assert reg.names("rollout_engines") == ["good"]
    assert reg.load("rollout_engines", "good") is GoodEngine
    info = reg.info("rollout_engines", "good")
    assert info.available and info.reason is None
    assert info.capabilities == {"fp8_weights", "logprobs"}
    assert (info.kind, info.distribution, info.version) == ("rollout_engines", "lumenrl-test", "1.2.3")
    assert info.target.endswith(":GoodEngine")


def test_probe_reason_and_crash_make_unavailable(reg):
    reg.register("rollout_engines", "nogpu", NoGpuEngine)
    reg.register("rollout_engines", "crash", CrashingProbe)
    assert reg.info("rollout_engines", "nogpu").reason == "no CUDA/ROCm GPU visible to torch"
    crash = reg.info("rollout_engines", "crash")
    assert not crash.available and "RuntimeError: driver exploded" in crash.reason
    assert reg.load("rollout_engines", "nogpu") is NoGpuEngine  # loadable, just unavailable


def test_probe_is_cached(reg):
    calls = []

    class Counting:
        capabilities = frozenset()

        @classmethod
        def probe(cls):
            calls.append(1)

    reg.register("loggers", "count", Counting)
    reg.info("loggers", "count")
    reg.info("loggers", "count")
    assert len(calls) == 1


def _write_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_spec_answers_info_and_load_imports_the_class(reg, tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "lumenrl_spec_plugin", "class Engine:\n    pass\n")
    probes = []
    spec = PluginSpec("lumenrl_spec_plugin:Engine", {"logprobs"}, probe=lambda: probes.append(1) or "no GPU here")
    reg.register("rollout_engines", "speced", spec, distribution="lumenrl-x", version="0.1")
    info = reg.info("rollout_engines", "speced")
    assert (info.capabilities, info.available, info.reason) == ({"logprobs"}, False, "no GPU here")
    assert info.target == "lumenrl_spec_plugin:Engine" and reg.spec("rollout_engines", "speced") is spec
    assert "lumenrl_spec_plugin" not in sys.modules  # answered from the spec, nothing imported
    cls = reg.load("rollout_engines", "speced")
    assert cls.__name__ == "Engine" and "lumenrl_spec_plugin" in sys.modules
    reg.info("rollout_engines", "speced")
    assert probes == [1]  # probed once


def test_spec_whose_target_fails_to_import(reg, tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "lumenrl_broken_plugin", "raise RuntimeError('needs a GPU build')\n")
    reg.register("rollout_engines", "broken", PluginSpec("lumenrl_broken_plugin:Engine", {"logprobs"}),
                 distribution="lumenrl-x", version="0.1")
    assert reg.info("rollout_engines", "broken").available  # the spec alone cannot tell
    with pytest.raises(PluginLoadError) as err:
        reg.load("rollout_engines", "broken")
    assert str(err.value) == ("rollout_engines plugin 'broken' (lumenrl-x 0.1): cannot import "
                              "lumenrl_broken_plugin:Engine: RuntimeError: needs a GPU build")
    info = reg.info("rollout_engines", "broken")
    assert not info.available and info.reason == "cannot import lumenrl_broken_plugin:Engine: RuntimeError: needs a GPU build"
    reg.register("rollout_engines", "missing_attr", PluginSpec("json:NoSuchEngine"))
    with pytest.raises(PluginLoadError, match="cannot import json:NoSuchEngine: AttributeError"):
        reg.load("rollout_engines", "missing_attr")


def test_spec_of_a_core_free_distribution_is_read_by_shape(reg):
    """lumenrl-quant depends on torch only: its manifest declares specs of PluginSpec's shape."""

    @dataclasses.dataclass(frozen=True)
    class Spec:
        target: str
        capabilities: frozenset = frozenset()
        probe: object = None
        requires: frozenset = frozenset({"critic"})

    reg.register("quant_schemes", "shaped", Spec("json:JSONDecoder", frozenset({"fp8_weights"}), lambda: None))
    assert reg.info("quant_schemes", "shaped").capabilities == {"fp8_weights"}
    assert reg.info("quant_schemes", "shaped").requires == {"critic"}
    assert reg.load("quant_schemes", "shaped") is json.JSONDecoder


def test_spec_of_a_class_entry_reads_the_class(reg):
    reg.register("rollout_engines", "nogpu", NoGpuEngine)
    spec = reg.spec("rollout_engines", "nogpu")
    assert spec.capabilities == {"logprobs"} and spec.unavailable_reason() == "no CUDA/ROCm GPU visible to torch"
    assert spec.target.endswith(":NoGpuEngine") and spec.load() is NoGpuEngine


def test_requires_is_declared_on_specs_classes_and_reported_by_info(reg):
    spec = PluginSpec("json:JSONDecoder", requires=["critic", "critic"])
    assert spec.requires == frozenset({"critic"}) and PluginSpec("json:JSONDecoder").requires == frozenset()
    with pytest.raises(TypeError, match="requires='critic': expected a collection"):
        PluginSpec("json:JSONDecoder", requires="critic")
    reg.register("advantage_estimators", "from_spec", spec)
    valued = type("Valued", (), {"capabilities": frozenset(), "requires": frozenset({"critic"})})
    reg.register("advantage_estimators", "from_class", valued)
    for name in ("from_spec", "from_class"):
        assert reg.info("advantage_estimators", name).requires == {"critic"}
        assert reg.spec("advantage_estimators", name).requires == {"critic"}


def test_plugin_spec_validates_its_target():
    with pytest.raises(ValueError, match="expected 'package.module:Class'"):
        PluginSpec("lumenrl_x.engines.Engine")
    assert PluginSpec("json:JSONDecoder", ["a", "a"]).capabilities == frozenset({"a"})
    assert PluginSpec("json:JSONDecoder").unavailable_reason() is None


def test_module_installed_reads_files_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "lumenrl_files_pkg"
    (pkg / "sub").mkdir(parents=True)
    for path in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        path.write_text("raise RuntimeError('imported')\n")
    (pkg / "sub" / "leaf.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_installed("lumenrl_files_pkg.sub") and module_installed("lumenrl_files_pkg.sub.leaf")
    assert not module_installed("lumenrl_files_pkg.sub.other") and not module_installed("lumenrl_no_such_mod.x")
    assert "lumenrl_files_pkg" not in sys.modules


def test_duplicate_names_both_distributions(reg):
    reg.register("rewards", "math", GoodEngine, distribution="pkg-a", version="0.1")
    with pytest.raises(DuplicatePluginError, match=r"'math'.*pkg-a 0\.1.*pkg-b 0\.2"):
        reg.register("rewards", "math", NoGpuEngine, distribution="pkg-b", version="0.2")
    reg.register("rewards", "math", GoodEngine, distribution="pkg-a", version="0.1")  # same dist+target: tolerated
    assert reg.load("rewards", "math") is GoodEngine


def test_unknown_name_lists_available_closest_and_install(reg):
    reg.register("rollout_engines", "native", GoodEngine)
    reg.register("rollout_engines", "hf", GoodEngine)
    with pytest.raises(UnknownPluginError) as err:
        reg.load("rollout_engines", "vlm")
    assert "available: hf, native" in str(err.value)
    with pytest.raises(UnknownPluginError) as err:
        reg.load("rollout_engines", "vllm")
    msg = str(err.value)
    assert "no rollout_engines plugin named 'vllm'" in msg and "pip install 'lumenrl-backends[vllm]'" in msg
    with pytest.raises(UnknownPluginError, match="did you mean 'native'"):
        reg.info("rollout_engines", "nativ")


def test_lazy_loading_and_import_failure(reg):
    calls = []

    def loader():
        calls.append(1)
        raise ModuleNotFoundError("No module named 'lumenrl_backends.engines'")

    reg.register_loader("rollout_engines", "later", loader, target="lumenrl_backends.engines.x:X")
    assert reg.names("rollout_engines") == ["later"] and calls == []  # discovery never imports
    info = reg.info("rollout_engines", "later")
    assert not info.available
    assert "cannot import lumenrl_backends.engines.x:X: ModuleNotFoundError" in info.reason
    with pytest.raises(PluginLoadError, match="ModuleNotFoundError"):
        reg.load("rollout_engines", "later")
    assert calls == [1]  # import attempted once, cached


def test_incompatible_core_requirement_blocks_import(reg):
    calls = []
    reg.register_loader("quant_schemes", "future", lambda: calls.append(1) or GoodEngine,
                        distribution="lumenrl-future", version="9.0", requires=["lumenrl-core>=9.0,<9.1"])
    info = reg.info("quant_schemes", "future")
    assert not info.available and calls == []
    assert f"lumenrl-future 9.0 requires lumenrl-core>=9.0,<9.1 but lumenrl-core {core_version()}" in info.reason
    assert reg.load("quant_schemes", "future", check_versions=False) is GoodEngine  # opt out


def test_core_requirement_problem_rules():
    reqs = ["torch>=2.6", "lumenrl-core>=0.1,<0.2", 'lumenrl-core>=5; extra == "future"']
    assert core_requirement_problem("lumenrl-x", "0.1", reqs, installed_core="0.1.3") is None
    assert "requires lumenrl-core>=0.1,<0.2" in core_requirement_problem("lumenrl-x", "0.1", reqs, "0.2.0")
    assert core_requirement_problem("lumenrl-quant", "0.1", ["torch>=2.6"], "7.0") is None
    assert core_requirement_problem("lumenrl_core", "0.1", ["lumenrl-core>=9"], "0.1") is None


def test_sibling_requirement_problems_one_line_each():
    reqs = ["torch>=2.6", "lumenrl-core>=0.1,<0.2", "lumenrl_quant>=0.1,<0.2", "lumenrl-moe>=0.1,<0.2",
            'lumenrl-sddd>=7; extra == "future"', "lumenrl-x>=1"]
    installed = {"lumenrl-core": "0.1.4", "lumenrl-quant": "0.3.0", "lumenrl-moe": None, "lumenrl-x": "2.0"}
    problems = sibling_requirement_problems("lumenrl-backends", "0.1.0", reqs, installed.get)
    assert problems == [
        "lumenrl-backends 0.1.0 requires lumenrl-quant>=0.1,<0.2 but lumenrl-quant 0.3.0 is installed "
        "(pip install 'lumenrl-quant>=0.1,<0.2')",
        "lumenrl-backends 0.1.0 requires lumenrl-moe>=0.1,<0.2 but it is not installed "
        "(pip install 'lumenrl-moe>=0.1,<0.2')",
    ]  # torch is not a sibling; the extra-only requirement does not apply; the others hold
    assert sibling_requirement_problems("lumenrl-quant", "0.1.0", ["lumenrl-quant>=9"], installed.get) == []


def test_registry_checks_every_sibling_requirement(reg):
    reg.register("quant_schemes", "needs_new_moe", GoodEngine, distribution="lumenrl-x", version="1.0",
                 requires=[f"lumenrl-core>={core_version()}", "lumenrl-moe>=9.0,<9.1"])
    info = reg.info("quant_schemes", "needs_new_moe")
    assert not info.available and "lumenrl-x 1.0 requires lumenrl-moe>=9.0,<9.1 but" in info.reason


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_real_entry_points_are_discovered():
    reg = PluginRegistry()
    assert {"grpo", "drgrpo", "rloo", "gae"} <= set(reg.names("advantage_estimators"))
    assert reg.distribution("advantage_estimators", "grpo")[0] == "lumenrl-core"
    # plugins of other distributions only where those are installed (this test also runs with core alone)
    if _installed("lumenrl-backends"):
        assert {"fsdp2", "megatron"} <= set(reg.names("training_backends"))
    if _installed("lumenrl-async"):
        assert reg.distribution("weight_syncs", "filesystem")[0] == "lumenrl-async"
    # every listed plugin yields an info (unimportable ones are reported, never raised)
    infos = reg.infos()
    assert all(i.available == (i.reason is None) for i in infos)


def test_default_registry_can_be_replaced(reg):
    old = set_registry(reg)
    try:
        assert get_registry() is reg
    finally:
        set_registry(old)


def test_module_probe_real_api_missing_and_namesake(tmp_path, monkeypatch):
    assert module_probe("json", ["dumps", "decoder.JSONDecoder"]) is None
    assert module_probe("email", ["mime.text.MIMEText"]) is None  # submodule along the path
    assert "not installed (pip install amd-aiter)" in module_probe("lumenrl_no_such_mod", install="amd-aiter")
    assert "not installed" in module_probe("lumenrl_no_such_mod.engine", ["TransferEngine"])
    # an unrelated package under the same import name (PyPI's `atom`, `lumen`): detected by API
    pkg = tmp_path / "lumenrl_fake_atom"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def unrelated():\n    return 1\n")
    (tmp_path / "lumenrl_broken_mod.py").write_text("raise RuntimeError('bad build')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lumenrl_fake_atom", "lumenrl_broken_mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    reason = module_probe("lumenrl_fake_atom", ["LLMEngine", "unrelated"])
    assert "lacks LLMEngine" in reason and "unrelated package with the same import name" in reason
    assert "RuntimeError: bad build" in module_probe("lumenrl_broken_mod")


def test_cuda_probe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_probe() == "no CUDA/ROCm GPU visible to torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100")
    assert cuda_probe() is None
    assert cuda_probe((8, 0)) is None
    assert cuda_probe((9, 0)) == "GPU compute capability 8.0 < required 9.0 (A100)"


def test_first_reason():
    assert first_reason(lambda: None, lambda: "b", lambda: "c") == "b"
    assert first_reason(lambda: None) is None


class FakeDist:
    def __init__(self, name: str, version: str, requires: list[str]):
        self.metadata = {"Name": name}
        self.version = version
        self.requires = requires


class FakeEntryPoint:
    def __init__(self, name: str, value: str, dist: FakeDist, obj=None):
        self.name, self.value, self.dist, self._obj = name, value, dist, obj

    def load(self):
        if self._obj is None:
            raise ModuleNotFoundError(f"No module named {self.value.split(':')[0]!r}")
        return self._obj


def fake_entry_points(monkeypatch, by_group):
    import lumenrl_core.plugins.registry as registry_module

    monkeypatch.setattr(registry_module.metadata, "entry_points", lambda group: by_group.get(group, []))


def test_discovery_from_metadata_with_versions_and_duplicates(monkeypatch):
    ok = FakeDist("lumenrl-x", "0.1.0", ["torch>=2.6", f"lumenrl-core=={core_version()}"])
    future = FakeDist("lumenrl-y", "2.0.0", ["lumenrl-core>=2.0,<2.1"])
    fake_entry_points(monkeypatch, {"lumenrl.rollout_engines": [
        FakeEntryPoint("good", "lumenrl_x.engines:Good", ok, GoodEngine),
        FakeEntryPoint("future", "lumenrl_y.engines:Future", future, GoodEngine),
        FakeEntryPoint("later", "lumenrl_x.later:Later", ok),
    ], "lumenrl.rewards": [
        FakeEntryPoint("math", "lumenrl_x.rewards:Math", ok, GoodEngine),
        FakeEntryPoint("math", "lumenrl_y.rewards:Math", future, GoodEngine),
    ]})
    reg = PluginRegistry()
    assert reg.names("rollout_engines") == ["future", "good", "later"]
    assert reg.info("rollout_engines", "good").available
    assert reg.info("rollout_engines", "good").distribution == "lumenrl-x"
    future_info = reg.info("rollout_engines", "future")
    assert not future_info.available and "lumenrl-y 2.0.0 requires lumenrl-core>=2.0,<2.1" in future_info.reason
    later = reg.info("rollout_engines", "later")
    assert later.reason == "cannot import lumenrl_x.later:Later: ModuleNotFoundError: No module named 'lumenrl_x.later'"
    for _ in range(2):  # raised on every use, not only the first
        with pytest.raises(DuplicatePluginError, match=r"lumenrl-x 0\.1\.0 \(lumenrl_x.rewards:Math\).*lumenrl-y 2\.0\.0"):
            reg.names("rewards")


def test_known_providers_match_the_installed_entry_points():
    """Every hint names the distribution that really ships the plugin (for installed distributions)."""
    for kind in KINDS:
        shipped = {ep.name: ep.dist.metadata["Name"] for ep in importlib.metadata.entry_points(group=group_of(kind))}
        for name, dist in shipped.items():
            if dist in {req.split("[")[0] for names in KNOWN_PROVIDERS.values() for req in names.values()}:
                assert KNOWN_PROVIDERS.get(kind, {}).get(name, "").split("[")[0] == dist, (kind, name)
        for name, requirement in KNOWN_PROVIDERS.get(kind, {}).items():
            dist = requirement.split("[")[0]
            try:
                importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue  # not installed here: nothing to compare
            assert shipped.get(name) == dist, f"{kind}/{name}: {requirement} is installed but does not ship it"
