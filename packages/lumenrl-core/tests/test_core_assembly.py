"""Strict assembly: every rule, with test plugins registered programmatically."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings

import pytest

from lumenrl_core.assembly import (
    AssemblyError,
    AssemblyWarning,
    assemble,
    build_with_keywords,
    config_is_moe,
    is_moe_model,
    model_type_of,
    plan_run,
)
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.plugins import PluginLoadError, PluginRegistry, PluginSpec

ALL_ENGINE_CAPS = {"fp8_weights", "mx_weights", "fp8_kv_cache", "route_recording", "interrupt_resume",
                   "hidden_state_capture", "logprobs", "router_probs", "cuda_graphs", "compile", "fuse_projections",
                   "overlap_sync", "share_prefill", "pack_prefill", "kv_block", "gpu_memory_utilization"}


# what a backend declares to read the policy.train keys, critic.enabled and the exact log-probs' trainer side
TRAIN_KEY_CAPS = {"values", "gradient_checkpointing", "compile_layers", "single_device", "group_projections", "packing",
                  "exact_logprobs"}


def plugin(name: str, caps=(), reason: str | None = None, **attrs) -> type:
    """A test plugin class with ``capabilities`` and a ``probe()`` returning ``reason``."""
    body = {"capabilities": frozenset(caps), "probe": classmethod(lambda cls: reason), **attrs}
    return type(name, (), body)


class Trainer:
    capabilities = frozenset({"grpo", "dapo", "ppo", "exact_logprobs", "online_sddd"})

    def __init__(self, plan):
        self.plan = plan

    @classmethod
    def probe(cls):
        return None

    @classmethod
    def from_plan(cls, plan):
        return cls(plan)


class Correction:
    capabilities = frozenset()

    def __init__(self, clip: float = 1.0):
        self.clip = clip

    @classmethod
    def probe(cls):
        return None


@pytest.fixture(autouse=True)
def _moe_layout_transformers(monkeypatch):
    """These tests check assembly logic against fake plugins: judge them as on a transformers with the
    MoE layout (the refusal on older ones is tested in test_core_config_refused.py)."""
    from lumenrl_core.assembly import requirements

    monkeypatch.setattr(requirements, "_installed_transformers", lambda: requirements.MOE_LAYOUT_TRANSFORMERS)


@pytest.fixture
def reg() -> PluginRegistry:
    r = PluginRegistry(discover=False)
    add = r.register
    add("training_backends", "fsdp2", plugin("FSDP2", TRAIN_KEY_CAPS), distribution="lumenrl-backends", version="0.1.0")
    add("training_backends", "megatron", plugin("Megatron", {"expert_parallel", "route_replay", "fp8_training"}))
    add("rollout_engines", "native", plugin("Native", ALL_ENGINE_CAPS))
    add("rollout_engines", "hf", plugin("HF", {"logprobs"}))
    add("rollout_engines", "vllm", plugin("VLLM", ALL_ENGINE_CAPS, reason="module 'vllm' is not installed"))
    add("advantage_estimators", "grpo", plugin("GRPO"))
    add("advantage_estimators", "gae", plugin("GAE", requires=frozenset({"critic"})))  # as the shipped spec
    add("policy_losses", "ppo_clip", plugin("PPOClip", __init__=lambda self, **keywords: None))  # takes them all
    add("rewards", "math", plugin("Math"))
    add("controllers", "local", plugin("Local", {"in_process", "dispatch_modes"}))
    add("trainers", "rl", Trainer)
    add("trainers", "sddd", plugin("SDDDTrainer", {"sddd"}))
    add("trainers", "async_rl", plugin("AsyncRL", {"async", "grpo", "dapo", "ppo"}))
    add("weight_syncs", "inprocess", plugin("InProc"))
    add("loggers", "jsonl", plugin("Jsonl"))
    add("quant_schemes", "fp8_block", plugin("Fp8Block"))
    add("quant_schemes", "mxfp4", plugin("MXFP4"))
    add("rollout_corrections", "tis_token", Correction)
    add("moe_routers", "qwen3_moe", plugin("SoftmaxTopK", {"route_recording", "route_replay"}))
    return r


@pytest.fixture
def cfg() -> RunConfig:
    c = RunConfig()
    c.logger.backends = ["jsonl"]
    return c


def problems(cfg, reg) -> list[str]:
    with pytest.raises(AssemblyError) as err:
        plan_run(cfg, registry=reg)
    lines = str(err.value).splitlines()
    assert len(lines) == len(err.value.violations) + 1  # header + one line per violation
    return [str(v) for v in err.value.violations]


def only(cfg, reg) -> str:
    found = problems(cfg, reg)
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------ the happy path


def test_default_config_plans_and_records_versions(cfg, reg):
    plan = plan_run(cfg, registry=reg)
    assert plan.training_backend_cls.__name__ == "FSDP2" and plan.rollout_engine_cls.__name__ == "Native"
    assert plan.trainer_cls is Trainer and list(plan.logger_classes) == ["jsonl"]
    assert plan.rollout_correction_cls is None and plan.rollout_quant_scheme_cls is None
    assert plan.reward_cls.__name__ == "Math" and plan.moe_router_cls is None
    assert plan.plugin_versions["training_backends/fsdp2"] == "lumenrl-backends 0.1.0"
    assert plan.version_of("training_backend") == "lumenrl-backends 0.1.0"
    assert plan.plugin_kinds["logger:jsonl"] == "loggers"
    assert plan.describe()["plugins"]["rollout_engine"] == "native"
    assert plan.warnings == ()


def test_assemble_builds_trainer_from_plan(cfg, reg):
    trainer = assemble(cfg, registry=reg)
    assert isinstance(trainer, Trainer) and trainer.plan.config is cfg


# ------------------------------------------------------------------ plugin resolution


def test_unknown_plugin_names_key_available_and_closest(cfg, reg):
    cfg.policy.rollout_engine = "nativ"
    msg = only(cfg, reg)
    assert msg.startswith("policy.rollout_engine='nativ': no rollout_engines plugin named 'nativ'")
    assert "available: hf, native, vllm" in msg and "did you mean 'native'" in msg


def test_unknown_plugin_is_fatal_even_when_not_strict(cfg, reg):
    cfg.assembly.strict_policy = False
    cfg.logger.backends = ["jsonl", "wandb"]
    msg = only(cfg, reg)
    assert msg.startswith("logger.backends='wandb'") and "pip install 'lumenrl-backends[wandb]'" in msg


def test_unavailable_plugin_strict_and_non_strict(cfg, reg):
    cfg.policy.rollout_engine = "vllm"
    assert only(cfg, reg) == ("policy.rollout_engine='vllm': rollout_engines plugin unavailable here: "
                              "module 'vllm' is not installed")
    cfg.assembly.strict_policy = False
    with pytest.warns(AssemblyWarning, match="unavailable here"):
        plan = plan_run(cfg, registry=reg)
    assert plan.rollout_engine_cls.__name__ == "VLLM" and len(plan.warnings) == 1


def test_plugin_module_that_fails_to_import(cfg, reg):
    def broken():
        raise ImportError("No module named 'lumenrl_backends.controllers'")

    reg.register_loader("controllers", "ray", broken, target="lumenrl_backends.controllers.ray:RayController")
    cfg.controller.name = "ray"
    msg = only(cfg, reg)
    assert msg.startswith("controller.name='ray': plugin cannot be loaded") and "ImportError" in msg


def test_check_without_loading_classes_then_classes_on_first_access(cfg, reg, tmp_path, monkeypatch):
    """plan_run(load_classes=False), as `lumenrl config check` runs it: plugins are checked from their
    specs and no class is imported until the plan is asked for one."""
    (tmp_path / "lumenrl_lazy_controller.py").write_text("class Local:\n    pass\n")
    (tmp_path / "lumenrl_gpu_controller.py").write_text("raise ImportError('CUDA build of torch needed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lumenrl_lazy_controller", "lumenrl_gpu_controller"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    reg.register("controllers", "lazy", PluginSpec("lumenrl_lazy_controller:Local", {"in_process"}))
    reg.register("controllers", "gpu", PluginSpec("lumenrl_gpu_controller:Local"))
    cfg.controller.name = "lazy"
    plan = plan_run(cfg, registry=reg, load_classes=False)
    assert "lumenrl_lazy_controller" not in sys.modules and plan.version_of("controller") == "test 0.0.0"
    assert plan.controller_cls.__name__ == "Local" and "lumenrl_lazy_controller" in sys.modules
    assert plan.controller_cls is plan.controller_cls
    assert plan.reward_cls.__name__ == "Math" and plan.moe_router_cls is None

    cfg.controller.name = "gpu"
    plan = plan_run(cfg, registry=reg, load_classes=False)  # the spec alone cannot tell the import fails
    with pytest.raises(PluginLoadError, match="cannot import lumenrl_gpu_controller:Local: ImportError: CUDA build"):
        plan.controller_cls  # noqa: B018 - the attribute access imports the class
    msg = only(cfg, reg)  # load_classes=True (assemble): one more problem in the list
    assert msg.startswith("controller.name='gpu': plugin cannot be loaded") and "CUDA build of torch needed" in msg


def test_incompatible_plugin_distribution_version(cfg, reg):
    reg.register("weight_syncs", "future", plugin("Future"), distribution="lumenrl-async", version="0.9.0",
                 requires=["lumenrl-core>=0.9,<0.10"])
    cfg.weight_sync.method = "future"
    msg = only(cfg, reg)
    assert msg.startswith("weight_sync.method='future'") and "incompatible version" in msg
    assert "lumenrl-async 0.9.0 requires lumenrl-core>=0.9,<0.10" in msg
    cfg.assembly.check_plugin_versions = False
    assert plan_run(cfg, registry=reg).weight_sync_cls.__name__ == "Future"


def test_allow_lists(cfg, reg):
    cfg.assembly.allowed_training_backends = ["megatron"]
    cfg.assembly.allowed_inference_backends = ["vllm", "hf"]
    found = problems(cfg, reg)
    assert found == [
        "policy.training_backend='fsdp2': not in assembly.allowed_training_backends; allowed: megatron",
        "policy.rollout_engine='native': not in assembly.allowed_inference_backends; allowed: vllm, hf",
    ]
    cfg.policy.training_backend, cfg.policy.rollout_engine = "megatron", "hf"
    assert plan_run(cfg, registry=reg).training_backend_cls.__name__ == "Megatron"


# ------------------------------------------------------------------ capabilities from config


def test_fp8_rollout_needs_fp8_weights_and_fp8_block_scheme(cfg, reg):
    cfg.quantization.rollout.precision = "fp8"
    plan = plan_run(cfg, registry=reg)
    assert plan.rollout_quant_scheme_cls.__name__ == "Fp8Block"
    assert plan.required_capabilities["rollout_engine"] == {"fp8_weights"}
    cfg.policy.rollout_engine = "hf"
    assert only(cfg, reg) == ("policy.rollout_engine='hf': rollout engine lacks capability 'fp8_weights' "
                              "required by quantization.rollout.precision='fp8'; choose a rollout engine "
                              "that declares it")


def test_mx_rollout_needs_mx_weights_and_scheme_override(cfg, reg):
    cfg.quantization.rollout.precision = "mxfp4"
    assert plan_run(cfg, registry=reg).rollout_quant_scheme_cls.__name__ == "MXFP4"
    cfg.quantization.rollout.precision = "mxfp8"  # derived scheme 'mxfp8' is not registered here
    msg = only(cfg, reg)
    assert msg.startswith("quantization.rollout.precision='mxfp8': no quant_schemes plugin named 'mxfp8'")
    cfg.quantization.rollout.precision, cfg.quantization.rollout.scheme = "fp8", "fp8_tensor"
    assert only(cfg, reg).startswith("quantization.rollout.scheme='fp8_tensor': no quant_schemes plugin")
    cfg.quantization.rollout.precision, cfg.quantization.rollout.scheme = "mxfp4", ""
    cfg.policy.rollout_engine = "hf"
    assert "lacks capability 'mx_weights'" in only(cfg, reg)


def test_scheme_without_low_precision_is_refused(cfg, reg):
    cfg.quantization.rollout.scheme = "fp8_block"
    msg = only(cfg, reg)
    assert msg.startswith("quantization.rollout.scheme='fp8_block': has no effect with quantization.rollout."
                          "precision='bf16'")


def test_fp8_kv_cache_needs_engine_capability(cfg, reg):
    cfg.quantization.rollout.kv_cache_dtype = "fp8"
    plan_run(cfg, registry=reg)
    cfg.policy.rollout_engine = "hf"
    assert "lacks capability 'fp8_kv_cache' required by quantization.rollout.kv_cache_dtype='fp8'" in only(cfg, reg)


def test_r3_needs_recording_replay_and_moe_model(cfg, reg, tmp_path):
    cfg.moe.r3.enabled = True
    cfg.policy.rollout_engine = "hf"  # no route_recording; fsdp2 has no route_replay; tiny model is dense
    found = problems(cfg, reg)
    assert len(found) == 3
    assert "policy.rollout_engine='hf': rollout engine lacks capability 'route_recording'" in found[0]
    assert "policy.training_backend='fsdp2': training backend lacks capability 'route_replay'" in found[1]
    assert found[2].startswith("moe.r3.enabled=True: needs an MoE model but policy.model_name=")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    cfg.policy.rollout_engine, cfg.policy.training_backend = "native", "megatron"
    cfg.policy.model_name = str(tmp_path)
    plan = plan_run(cfg, registry=reg)
    assert plan.model_is_moe is True
    assert plan.required_capabilities == {"rollout_engine": {"route_recording"}, "training_backend": {"route_replay"},
                                          "trainer": {"grpo"}}
    cfg.policy.rollout.speculative.draft_path = str(tmp_path / "draft")  # spec decoding records no routes
    assert any(p.startswith("moe.r3.enabled=True: speculative decoding (policy.rollout.speculative.draft_path) does "
                            "not record routes") for p in problems(cfg, reg))


def test_r3_router_by_model_type_or_by_name(cfg, reg, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    cfg.moe.r3.enabled, cfg.policy.training_backend, cfg.policy.model_name = True, "megatron", str(tmp_path)
    plan = plan_run(cfg, registry=reg)
    assert plan.moe_router_cls.__name__ == "SoftmaxTopK" and plan.plugin_names["moe_router"] == "qwen3_moe"
    assert plan.plugin_versions["moe_routers/qwen3_moe"] == "test 0.0.0"
    cfg.moe.r3.router = "qwen3_mo"
    assert only(cfg, reg).startswith("moe.r3.router='qwen3_mo': no moe_routers plugin named 'qwen3_mo'")
    cfg.moe.r3.router, cfg.policy.model_name = "", "lumenrl:tiny-mixtral"  # family from the built-in name
    # an MoE family without a router plugin is refused, naming its model type
    assert only(cfg, reg).startswith("moe.r3.enabled=True: no lumenrl.moe_routers plugin for model_type='mixtral'")


def test_r3_on_unknown_model_warns_instead_of_guessing(cfg, reg):
    cfg.moe.r3.enabled, cfg.policy.training_backend = True, "megatron"
    cfg.policy.model_name = "some-org/unknown-model-7b"
    with pytest.warns(AssemblyWarning, match="cannot tell whether it is MoE"):
        plan = plan_run(cfg, registry=reg)
    assert plan.model_is_moe is None


def test_partial_rollout_needs_interrupt_resume_and_async(cfg, reg):
    cfg.async_training.partial_rollout = True
    cfg.policy.rollout_engine = "hf"
    found = problems(cfg, reg)
    assert found[0].startswith("async_training.partial_rollout=True: partial rollout only exists in async")
    assert "lacks capability 'interrupt_resume' required by async_training.partial_rollout=True" in found[1]
    cfg.async_training.enabled, cfg.policy.rollout_engine = True, "native"
    assert "trainer lacks capability 'async' required by async_training.enabled=True" in only(cfg, reg)
    cfg.trainer.name = "async_rl"
    plan_run(cfg, registry=reg)
    cfg.async_training.resume_kv = "keep"  # the engine must keep an interrupted row's cache across an update
    assert only(cfg, reg) == ("policy.rollout_engine='native': rollout engine lacks capability 'kept_kv_across_updates' "
                              "required by async_training.resume_kv='keep'; choose a rollout engine that declares it")
    reg.register("rollout_engines", "keeper", plugin("Keeper", ALL_ENGINE_CAPS | {"kept_kv_across_updates"}))
    cfg.policy.rollout_engine = "keeper"
    assert "kept_kv_across_updates" in plan_run(cfg, registry=reg).required_capabilities["rollout_engine"]


def test_async_rl_on_ray_needs_a_cross_node_weight_sync(cfg, reg):
    reg.register("controllers", "ray", plugin("Ray"))
    reg.register("weight_syncs", "collective", plugin("Collective", {"cross_process", "cross_node", "collective"}))
    cfg.trainer.name, cfg.async_training.enabled, cfg.controller.name = "async_rl", True, "ray"
    assert only(cfg, reg) == ("weight_sync.method='inprocess': weight sync lacks capability 'cross_node' required "
                              "by controller.name='ray'; choose a weight sync that declares it")
    cfg.weight_sync.method = "collective"
    plan_run(cfg, registry=reg)
    cfg.trainer.name, cfg.async_training.enabled, cfg.weight_sync.method = "rl", False, "inprocess"
    plan_run(cfg, registry=reg)  # the synchronous trainer on Ray syncs over its own channel


def test_sddd_trainer_needs_hidden_state_capture(cfg, reg):
    cfg.trainer.name, cfg.algorithm.name, cfg.policy.rollout_engine = "sddd", "sddd", "hf"
    assert "lacks capability 'hidden_state_capture' required by trainer.name='sddd'" in only(cfg, reg)


def test_sddd_algorithm_and_trainer_go_together(cfg, reg):
    cfg.trainer.name = "sddd"
    assert only(cfg, reg).startswith("algorithm.name='grpo': algorithm.name='sddd' and trainer.name='sddd' go together")


def test_training_precision_rules(cfg, reg):
    cfg.quantization.training.precision = "fp8"
    assert "lacks capability 'fp8_training'" in only(cfg, reg)
    cfg.policy.training_backend = "megatron"
    plan_run(cfg, registry=reg)
    for precision in ("mxfp4", "mxfp8"):
        cfg.quantization.training.precision = precision
        assert only(cfg, reg) == (f"quantization.training.precision='{precision}': not supported for training "
                                  "(rollout only); allowed: bf16, fp32, fp8")


def test_expert_parallel_needs_backend_support(cfg, reg):
    cfg.moe.expert_parallel_size = 4
    cfg.policy.model_name = "lumenrl:tiny-qwen3-moe"
    msg = only(cfg, reg)
    assert msg.startswith("policy.training_backend='fsdp2'") and "'expert_parallel' required by moe.expert_parallel_size=4" in msg
    cfg.policy.training_backend = "megatron"
    assert plan_run(cfg, registry=reg).model_is_moe is True


def test_ppo_needs_critic_and_gae(cfg, reg):
    cfg.algorithm.name = "ppo"
    assert problems(cfg, reg) == [
        "critic.enabled=False: algorithm.name='ppo' needs a critic; set critic.enabled=true",
        "algorithm.adv_estimator='grpo': algorithm.name='ppo' uses value-based advantages; allowed: 'gae'",
    ]
    cfg.critic.enabled, cfg.algorithm.adv_estimator = True, "gae"
    assert plan_run(cfg, registry=reg).adv_estimator_cls.__name__ == "GAE"


def test_gae_without_critic_is_refused(cfg, reg):
    cfg.algorithm.adv_estimator = "gae"
    assert only(cfg, reg) == (
        "algorithm.adv_estimator='gae': advantage_estimators plugin 'gae' (test 0.0.0) requires "
        "run feature 'critic', which this config does not provide: critic.enabled=False; set critic.enabled=true "
        "(the batch then carries the critic's 'values')")
    cfg.critic.enabled = True
    assert plan_run(cfg, registry=reg, load_classes=False).plugin_names["adv_estimator"] == "gae"


def test_shipped_gae_spec_requires_the_critic():
    from lumenrl_core import plugin_manifest

    assert plugin_manifest.GAE.requires == {"critic"}
    assert all(not spec.requires for spec in (plugin_manifest.GRPO, plugin_manifest.RLOO, plugin_manifest.MATH))


def test_plugin_requirements_fit_or_are_refused_under_the_strict_policy(cfg, reg):
    reg.register("rewards", "digits", plugin("Digits", requires=frozenset({"task:arithmetic"})),
                 distribution="acme-rewards", version="2.1")
    reg.register("advantage_estimators", "valued", plugin("Valued", requires=frozenset({"critic", "tokens"})),
                 distribution="acme-rewards", version="2.1")
    cfg.reward.name, cfg.dataset.name = "digits", "arithmetic"
    assert plan_run(cfg, registry=reg).plugin_names["reward"] == "digits"  # provided: task:arithmetic
    cfg.dataset.name, cfg.algorithm.adv_estimator = "countdown", "valued"
    assert problems(cfg, reg) == [
        "algorithm.adv_estimator='valued': advantage_estimators plugin 'valued' (acme-rewards 2.1) requires run "
        "feature 'critic', which this config does not provide: critic.enabled=False; set critic.enabled=true "
        "(the batch then carries the critic's 'values')",
        "algorithm.adv_estimator='valued': advantage_estimators plugin 'valued' (acme-rewards 2.1) requires run "
        "feature 'tokens', which this config does not provide: no config provides it (unknown run feature; "
        "known: critic, task:<dataset.name>)",
        "reward.name='digits': rewards plugin 'digits' (acme-rewards 2.1) requires run feature 'task:arithmetic', "
        "which this config does not provide: dataset.name='countdown'; it scores rows of task 'arithmetic' "
        "(dataset.name='arithmetic')",
    ]
    cfg.assembly.strict_policy = False  # policy, not fatal: warnings, and the plan keeps them for the record
    with pytest.warns(AssemblyWarning, match="requires run feature 'critic'"):
        plan = plan_run(cfg, registry=reg)
    assert len(plan.warnings) == 3


def test_run_features_follow_the_config(cfg):
    from lumenrl_core.assembly import run_features

    assert run_features(cfg) == {"task:arithmetic"}
    cfg.critic.enabled, cfg.dataset.name = True, "jsonl"
    assert run_features(cfg) == {"critic", "task:jsonl"}


def test_rollout_correction_mode_must_resolve(cfg, reg):
    cfg.quantization.rollout_correction.enabled = True
    cfg.quantization.rollout_correction.mode = "tis_tok"
    msg = only(cfg, reg)
    assert msg.startswith("quantization.rollout_correction.mode='tis_tok'") and "did you mean 'tis_token'" in msg
    cfg.quantization.rollout_correction.mode = "tis_token"
    cfg.quantization.rollout_correction.clip = 3.5
    plan = plan_run(cfg, registry=reg)
    assert plan.build_rollout_correction().clip == 3.5  # config field mapped to the keyword


def test_reward_function_syntax_and_module(cfg, reg, tmp_path, monkeypatch):
    for bad, why in (("json.dumps", "expected 'package.module:function'"), ("json:", "expected"),
                     ("no_such_pkg_xyz.mod:fn", "module 'no_such_pkg_xyz.mod' cannot be found")):
        cfg.reward.function = bad
        msg = only(cfg, reg)
        assert msg.startswith(f"reward.function={bad!r}") and why in msg
    (tmp_path / "asm_user_reward.py").write_text(
        "def length_reward(prompts, responses, extra):\n    return [float(len(r)) for r in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg.reward.function = "asm_user_reward:length_reward"
    plan = plan_run(cfg, registry=reg)
    assert plan.reward_cls is None and "reward" not in plan.plugin_names
    assert plan.build_reward()(["p", "q"], ["ab", "abc"], [{}, {}]) == [2.0, 3.0]
    cfg.reward.function = f"{tmp_path / 'asm_user_reward.py'}:length_reward"  # a file path, as the loader takes
    assert plan_run(cfg, registry=reg).build_reward()(["p"], ["abcd"], [{}]) == [4.0]
    cfg.reward.function = f"{tmp_path / 'missing.py'}:length_reward"
    assert "does not exist" in only(cfg, reg)


def test_all_violations_reported_at_once(cfg, reg):
    cfg.policy.rollout_engine = "hf"
    cfg.policy.training_backend = "fsdp3"
    cfg.algorithm.name = "ppo"
    cfg.quantization.training.precision = "mxfp4"
    cfg.quantization.rollout.precision = "fp8"
    cfg.assembly.allowed_inference_backends = ["native"]
    cfg.reward.function = "not a function"
    found = problems(cfg, reg)
    keys = [f.split("=", 1)[0] for f in found]
    assert keys == ["quantization.training.precision", "critic.enabled", "algorithm.adv_estimator",
                    "reward.function", "policy.training_backend", "policy.rollout_engine", "policy.rollout_engine"]
    assert "not in assembly.allowed_inference_backends" in found[5] and "'fp8_weights'" in found[6]


def test_non_strict_turns_policy_violations_into_warnings(cfg, reg):
    cfg.assembly.strict_policy = False
    cfg.quantization.rollout.precision = "fp8"
    cfg.policy.rollout_engine = "hf"
    cfg.algorithm.adv_estimator = "gae"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_run(cfg, registry=reg)
    messages = [str(w.message) for w in caught if issubclass(w.category, AssemblyWarning)]
    assert len(messages) == 2 and messages == list(plan.warnings)


# ------------------------------------------------------------------ helpers


def test_config_is_moe_and_names(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path / "cache"))
    assert config_is_moe({"model_type": "mixtral"})
    assert config_is_moe({"model_type": "x", "n_routed_experts": 64})
    assert config_is_moe({"model_type": "llava", "text_config": {"num_local_experts": 8}})
    assert not config_is_moe({"model_type": "qwen3", "num_experts": 1})
    assert is_moe_model("Qwen/Qwen3-30B-A3B") == (True, "known MoE model family")
    assert is_moe_model("deepseek-ai/DeepSeek-V3")[0] is True
    assert is_moe_model("lumenrl:tiny-qwen3-arith") == (False, "built-in model name")
    assert is_moe_model("lumenrl:tiny-mixtral")[0] is True and is_moe_model("lumenrl:tiny-deepseek_v3")[0] is True
    assert is_moe_model("meta-llama/Llama-3.1-8B-Instruct-nonexistent-zz")[0] is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert is_moe_model(str(tmp_path))[0] is False
    (tmp_path / "config.json").write_text("{not json")
    is_moe, how = is_moe_model(str(tmp_path))
    assert is_moe is None and how.startswith(f"cannot read {tmp_path / 'config.json'}")
    assert model_type_of(str(tmp_path)) is None
    built = tmp_path / "cache" / "tiny-custom" / "0123abcd"  # a materialised built-in (<name>/<key>/): its config decides
    built.mkdir(parents=True)
    (built / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    assert is_moe_model("lumenrl:tiny-custom")[0] is not True  # no manifest: an unfinished build is not read
    (built / "lumenrl-build.json").write_text(json.dumps({"key": "0123abcd"}))
    assert is_moe_model("lumenrl:tiny-custom")[0] is True
    assert model_type_of("lumenrl:tiny-custom") == "qwen3_moe"  # from the cached config.json
    assert model_type_of("lumenrl:tiny-glm4_moe") == "glm4_moe" and model_type_of("org/unknown") is None


def test_build_with_keywords_passes_only_accepted():
    class Loss:
        def __init__(self, *, clip_ratio_low: float, loss_agg_mode: str = "token-mean"):
            self.args = (clip_ratio_low, loss_agg_mode)

    class Open:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    assert build_with_keywords(Loss, {"clip_ratio_low": 0.2, "gamma": 1.0}).args == (0.2, "token-mean")
    assert build_with_keywords(Open, {"a": 1}).kwargs == {"a": 1}


def test_fuse_mlp_needs_the_fp8_row_scheme(cfg, reg):
    cfg.quantization.rollout.fuse_mlp = True
    with pytest.warns(AssemblyWarning, match="fuse_mlp=True has no effect with .*precision='bf16'"):
        plan_run(cfg, registry=reg)
    cfg.quantization.rollout.precision = "fp8"  # default scheme fp8_block
    msg = only(cfg, reg)
    assert msg.startswith("quantization.rollout.fuse_mlp=True: ") and "resolves to 'fp8_block'" in msg
    assert "Allowed: false, or quantization.rollout.scheme='fp8_row'" in msg
    reg.register("quant_schemes", "fp8_row", plugin("Fp8Row"))
    cfg.quantization.rollout.scheme = "fp8_row"
    assert plan_run(cfg, registry=reg).config.quantization.rollout.fuse_mlp is True


def test_quantize_lm_head_refused_for_a_tied_model_before_loading(cfg, reg, tmp_path):
    from lumenrl_core.assembly.model_kind import ties_word_embeddings

    cfg.quantization.rollout.quantize_lm_head = True
    with pytest.warns(AssemblyWarning, match="quantize_lm_head=True has no effect with .*precision='bf16'"):
        plan_run(cfg, registry=reg)
    cfg.quantization.rollout.precision = "fp8"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    cfg.policy.model_name = str(tmp_path)
    assert ties_word_embeddings(str(tmp_path)) == (True, f"tie_word_embeddings in {tmp_path / 'config.json'}")
    msg = only(cfg, reg)
    assert msg.startswith("quantization.rollout.quantize_lm_head=True: policy.model_name=")
    assert "ties its output head to the input embeddings" in msg and "Allowed: false for a tied model" in msg
    cfg.assembly.strict_policy = False  # still fatal: the run cannot be built correctly
    with pytest.raises(AssemblyError, match="quantize_lm_head"):
        plan_run(cfg, registry=reg)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "text_config": {"tie_word_embeddings": False}}))
    assert plan_run(cfg, registry=reg).config.quantization.rollout.quantize_lm_head is True
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))  # unset: the engine decides
    with pytest.warns(AssemblyWarning, match="cannot tell whether .* ties its embeddings"):
        plan_run(cfg, registry=reg)


def test_parallel_mesh_refusals_name_the_numbers(cfg, reg, tmp_path):
    cfg.policy.parallel.tp = 2
    assert "'tensor_parallel' required by policy.parallel.tp=2" in only(cfg, reg)  # backend lacks the capability
    cfg.policy.parallel.tp, cfg.policy.parallel.cp = 1, 2
    assert "'context_parallel' required by policy.parallel.cp=2" in only(cfg, reg)
    cfg.policy.parallel.cp, cfg.policy.parallel.pp = 1, 2
    assert "'pipeline_parallel' required by policy.parallel.pp=2" in only(cfg, reg)
    cfg.policy.parallel.pp = 1
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_attention_heads": 6, "num_key_value_heads": 2, "num_experts": 6}))
    cfg.policy.model_name, cfg.policy.training_backend = str(tmp_path), "megatron"
    cfg.moe.expert_parallel_size = 4
    assert only(cfg, reg) == f"moe.expert_parallel_size=4: does not divide the 6 experts of {tmp_path}"
    cfg.moe.expert_parallel_size = 3
    plan_run(cfg, registry=reg)
    reg.register("training_backends", "tpb", plugin("TPB", {"tensor_parallel", "expert_parallel"}))
    cfg.policy.training_backend, cfg.policy.parallel.tp = "tpb", 3
    assert only(cfg, reg) == f"policy.parallel.tp=3: does not divide num_key_value_heads=2 of {tmp_path}"
    cfg.policy.parallel.tp, cfg.cluster.gpus_per_node = 2, 3
    assert only(cfg, reg) == ("policy.parallel='tp=2 cp=1 pp=1': tp*cp*pp=2 must divide the world size 3 "
                              "(cluster.num_nodes*gpus_per_node)")
    cfg.cluster.gpus_per_node = 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_attention_heads": 6,
                                                      "num_key_value_heads": 2, "num_experts": 6,
                                                      "moe_intermediate_size": 3}))
    assert only(cfg, reg) == f"policy.parallel.tp=2: does not divide moe_intermediate_size=3 of {tmp_path}"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_attention_heads": 6,
                                                      "num_key_value_heads": 2, "num_experts": 6}))
    reg.register("training_backends", "tpl", plugin("TPL", {"tensor_parallel", "expert_parallel", "lora"}))
    cfg.policy.training_backend, cfg.policy.lora.rank, cfg.policy.lora.dropout = "tpl", 4, 0.1
    found = [p for p in problems(cfg, reg) if "LoRA needs peft" not in p]  # peft is an extra (absent: min env)
    assert len(found) == 1 and found[0].startswith("policy.lora.dropout=0.1: draws a different mask on each rank")
    cfg.policy.lora.dropout = 0.0
    if importlib.util.find_spec("peft") is not None:
        plan_run(cfg, registry=reg)  # LoRA under tp=2 (dropout 0)
    cfg.policy.training_backend, cfg.policy.lora.rank = "tpb", 0
    reg.register("controllers", "ray", plugin("Ray", {"dispatch_modes", "multi_node"}))
    cfg.controller.name = "ray"  # splits every batch over its workers: a TP group would get different rows
    assert "controller lacks capability 'in_process' required by policy.parallel.tp=2" in only(cfg, reg)


def test_rollout_tensor_parallel_only_on_sharding_engines(cfg, reg):
    cfg.policy.rollout.tensor_parallel_size = 2
    assert only(cfg, reg) == ("policy.rollout.tensor_parallel_size=2: rollout engine 'native' decodes on one device; "
                              "use policy.rollout_engine='vllm' or 'sglang' for tensor parallel decode")


def test_r3_distribution_mode_needs_recorded_router_probabilities():
    from lumenrl_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="moe.r3.record_router_logits"):
        load_config(None, ["moe.r3.enabled=true", "moe.r3.replay_mode=distribution"])
    cfg = load_config(None, ["moe.r3.enabled=true", "moe.r3.replay_mode=distribution",
                             "moe.r3.record_router_logits=true"])
    assert cfg.moe.r3.replay_mode == "distribution"


@pytest.mark.parametrize(("key", "value", "capability"), [
    ("critic.enabled", True, "values"),
    ("policy.train.gradient_checkpointing", True, "gradient_checkpointing"),
    ("policy.train.compile_layers", True, "compile_layers"),
    ("policy.train.single_device", "on", "single_device"),
    ("policy.train.group_projections", "on", "group_projections"),
    ("policy.train.packing", "trim", "packing"),
    ("policy.rollout.exact_logprobs", True, "exact_logprobs"),
])
def test_training_keys_need_a_backend_that_reads_them(cfg, reg, key, value, capability):
    """A backend without the capability would skip the key: refused before any model loads, naming it."""
    section, name = key.rsplit(".", 1)
    target = cfg
    for part in section.split("."):
        target = getattr(target, part)
    setattr(target, name, value)
    cfg.policy.training_backend, cfg.policy.rollout_engine = "megatron", "native"
    assert only(cfg, reg) == (f"policy.training_backend='megatron': training backend lacks capability "
                              f"'{capability}' required by {key}={value!r}; choose a training backend that declares it")
    cfg.policy.training_backend = "fsdp2"
    assert capability in plan_run(cfg, registry=reg).required_capabilities["training_backend"]


def test_choices_a_backend_honours_without_reading_them_are_not_refused(cfg, reg):
    """single_device=off, group_projections=auto/off and packing=auto/none: a backend with no one-rank path,
    grouped projections or packing does what they ask."""
    cfg.policy.training_backend = "megatron"
    for single, grouping, packing in (("off", "off", "none"), ("auto", "auto", "auto")):
        cfg.policy.train.single_device, cfg.policy.train.packing = single, packing
        cfg.policy.train.group_projections = grouping
        needed = plan_run(cfg, registry=reg).required_capabilities.get("training_backend", ())
        assert "single_device" not in needed and "group_projections" not in needed


@pytest.mark.parametrize(("key", "value"), [
    ("cuda_graphs", False), ("compile", "full"), ("fuse_projections", False), ("overlap_sync", False),
    ("share_prefill", False), ("pack_prefill", "off"), ("kv_block", 256), ("gpu_memory_utilization", 0.8),
])
def test_engine_keys_need_an_engine_that_reads_them(cfg, reg, key, value):
    """Engine knobs away from their defaults: an engine that does not declare them (hf here) would ignore them."""
    setattr(cfg.policy.rollout, key, value)
    cfg.policy.rollout_engine = "hf"
    assert only(cfg, reg) == (f"policy.rollout_engine='hf': rollout engine lacks capability '{key}' required by "
                              f"policy.rollout.{key}={value!r}; choose a rollout engine that declares it")
    cfg.policy.rollout_engine = "native"
    assert key in plan_run(cfg, registry=reg).required_capabilities["rollout_engine"]


def test_trainer_must_run_the_algorithm_and_the_per_step_checks(cfg, reg):
    cfg.algorithm.name = "grpo"
    assert plan_run(cfg, registry=reg).required_capabilities["trainer"] == {"grpo"}
    reg.register("trainers", "grpo_only", plugin("GRPOOnly", {"grpo"}))
    cfg.trainer.name, cfg.algorithm.name = "grpo_only", "dapo"
    cfg.algorithm.dynamic_sampling, cfg.algorithm.clip_ratio_high = True, 0.28
    assert only(cfg, reg) == ("trainer.name='grpo_only': trainer lacks capability 'dapo' required by "
                              "algorithm.name='dapo'; choose a trainer that declares it")
    cfg.algorithm.name = "grpo"
    cfg.policy.rollout.speculative.draft_path, cfg.policy.rollout.speculative.online_sddd_steps = "/d", 2
    assert any("trainer.name='grpo_only': trainer lacks capability 'online_sddd' required by "
               "policy.rollout.speculative.online_sddd_steps=2" in p for p in problems(cfg, reg))


def test_dapo_needs_dynamic_sampling_and_clip_higher(cfg, reg):
    cfg.algorithm.name = "dapo"
    found = problems(cfg, reg)
    assert [f.split(":")[0] for f in found] == ["algorithm.dynamic_sampling=False", "algorithm.clip_ratio_high=0.2"]
    cfg.algorithm.dynamic_sampling, cfg.algorithm.clip_ratio_high = True, 0.28
    assert plan_run(cfg, registry=reg).required_capabilities["trainer"] == {"dapo"}


def test_config_values_a_plugin_does_not_take_are_refused(cfg, reg):
    """build_with_keywords passes only what a constructor takes: a set value it drops is refused at planning."""
    cfg.algorithm.gamma = 0.9  # the fake grpo estimator takes no gamma
    assert only(cfg, reg) == ("algorithm.gamma=0.9: has no effect: the adv estimator plugin 'grpo' takes no 'gamma'; "
                              "allowed: 1.0 (the default), or a plugin that takes it")
    cfg.algorithm.gamma = 1.0
    cfg.policy.rollout.max_new_tokens = 7  # read by the engine whatever the loss takes
    plan_run(cfg, registry=reg)

    class Banded(Correction):
        config_keywords = frozenset({"mask_low", "mask_high"})  # declared: the clip field is shared but unused

    reg.register("rollout_corrections", "banded", Banded)
    assert build_with_keywords(Banded, {"clip": 3.0}).clip == 1.0  # declared keywords only: its own default kept
    rc = cfg.quantization.rollout_correction
    rc.enabled, rc.mode, rc.clip = True, "banded", 3.0
    assert only(cfg, reg).startswith("quantization.rollout_correction.clip=3.0: has no effect: the rollout "
                                      "correction plugin 'banded' takes no 'clip'")
    rc.mode = "tis_token"  # Correction(clip=...) takes it
    plan_run(cfg, registry=reg)
    rc.mask_low = 0.5  # not a constructor parameter of Correction
    assert only(cfg, reg).startswith("quantization.rollout_correction.mask_low=0.5: has no effect")
