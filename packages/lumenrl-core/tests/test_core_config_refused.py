"""Issue #16: every key read or refused, semantic checks at load, original-LumenRL keys, free text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lumenrl_core.config import ConfigError, ConfigProblems, dump_config, legacy, load_config
from lumenrl_core.config.legacy import LEGACY
from lumenrl_core.config.refusals import NOT_YET_BUILT
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.config.semantic import cuda_device_count
from lumenrl_core.config.typed import all_keys, fields_of, section_type

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"


def _leaf_keys() -> list[str]:
    out = []
    for key in all_keys(RunConfig):
        cls, spec = RunConfig, None
        for part in key.split("."):
            spec = fields_of(cls)[part]
            cls = section_type(spec.type)
        if cls is None:
            out.append(key)
    return out


def _sources() -> dict[Path, str]:
    # the config package declares, converts and maps keys; of its modules only semantic.py reads values
    files = [p for p in ROOT.glob("packages/*/src/**/*.py")
             if "lumenrl_core/config/" not in p.as_posix() or p.name == "semantic.py"]
    return {p: p.read_text(encoding="utf-8") for p in files}


def _is_read(key: str, sources: dict[Path, str]) -> bool:
    """``parent.leaf`` accessed somewhere, or ``.leaf`` accessed in a file that names the section ``parent``."""
    parts = key.split(".")
    leaf = re.compile(rf"\.{re.escape(parts[-1])}\b")
    if len(parts) == 1:
        return any(leaf.search(t) for t in sources.values())
    parent = parts[-2]
    joined = re.compile(rf"\b{re.escape(parent)}\.{re.escape(parts[-1])}\b")
    section = re.compile(rf"\b{re.escape(parent)}\b")
    return any(joined.search(t) or (leaf.search(t) and section.search(t)) for t in sources.values())


def test_every_key_read_or_refused():
    sources = _sources()
    unread = [k for k in _leaf_keys() if k not in NOT_YET_BUILT and not _is_read(k, sources)]
    assert unread == [], f"schema keys no code reads and no refusal covers: {unread}"


def test_read_detector_is_not_vacuous():
    sources = _sources()
    assert not _is_read("policy.no_such_key_xyz", sources)
    assert _is_read("policy.rollout.temperature", sources)


def test_refusal_table_keys_exist_and_defaults_load():
    keys = set(all_keys(RunConfig))
    assert set(NOT_YET_BUILT) <= keys
    load_config(None)  # every entry at its default loads


def _problems(overrides, path=None) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    err = info.value
    return err.errors if isinstance(err, ConfigProblems) else [err]


# every silent case of issue #16 that is refused at load: overrides -> the key the error names
SILENT = [
    (["policy.optim.lr=inf"], "policy.optim.lr"),
    (["policy.optim.grad_clip=-inf"], "policy.optim.grad_clip"),
    (["policy.train.mini_batch_size=100000"], "policy.train.mini_batch_size"),
    (["policy.train.mini_batch_size=3"], "policy.train.mini_batch_size"),
    (["async_training.enabled=true"], "async_training.enabled"),
    (["async_training.queue_size=4"], "async_training.queue_size"),
    (["async_training.staleness_from=start"], "async_training.staleness_from"),
    (["trainer.name=async_rl", "async_training.enabled=true", "async_training.staleness_from=start"],
     "async_training.staleness_from"),  # without partial_rollout: one version per group, nothing to choose
    (["async_training.staleness_from=newest"], "async_training.staleness_from"),
    (["async_training.resume_kv=keep"], "async_training.resume_kv"),
    (["trainer.name=async_rl", "async_training.enabled=true", "async_training.resume_kv=keep"],
     "async_training.resume_kv"),  # without partial_rollout no sequence is interrupted by an update
    (["trainer.name=async_rl", "async_training.enabled=true", "async_training.partial_rollout=true",
      "async_training.resume_kv=keep", "quantization.rollout.kv_cache_dtype=fp8"], "async_training.resume_kv"),
    (["trainer.name=async_rl", "async_training.enabled=true", "async_training.partial_rollout=true",
      "async_training.resume_kv=keep", "moe.r3.enabled=true"], "async_training.resume_kv"),
    (["async_training.resume_kv=reuse"], "async_training.resume_kv"),
    (["weight_sync.method=collective"], "weight_sync.method"),
    (["weight_sync.snapshot_dir=/tmp/snap"], "weight_sync.snapshot_dir"),
    (["critic.cliprange_value=0"], "critic.cliprange_value"),
    (["algorithm.overlong_buffer_len=100"], "algorithm.overlong_buffer_len"),
    (["policy.rollout.temperature=inf"], "policy.rollout.temperature"),
    (["policy.rollout.temperature=0"], "policy.rollout.temperature"),
    (["policy.rollout.n=1"], "policy.rollout.n"),
    (["algorithm.name=dapo", "policy.rollout.n=1"], "policy.rollout.n"),
    (["algorithm.clip_ratio_c=1.0"], "algorithm.clip_ratio_c"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c"),
    (["quantization.rollout.precision=mxfp4", "quantization.rollout.scheme=fp8_block"],
     "quantization.rollout.scheme"),
    (["policy.model_name=123"], "policy.model_name"),
    (["policy.tokenizer_name=null"], "policy.tokenizer_name"),
    (["policy.model_name=Nobody/not-cached-model-xyz"], "policy.model_name"),
    (["policy.model_name=lumenrl:tiny-qwen3-arithm"], "policy.model_name"),
    (["policy.tokenizer_name=lumenrl:nope"], "policy.tokenizer_name"),
    (["controller.ray.rollout.dispatch_mode=direct_rollout_method"], "controller.ray.roles.rollout.dispatch_mode"),
    (["controller.ray.actor.dispatch_mode=broadcast"], "controller.ray.roles.actor.dispatch_mode"),
    (["moe.r3.enabled=true", "moe.r3.replay_mode=distribution"], "moe.r3.record_router_logits"),
    (["assembly.use_new_assembler=false"], "assembly.use_new_assembler"),
    (["dataset.prompt_key=[a, b]"], "dataset.prompt_key"),
    (["dataset.prompt_key={a: b}"], "dataset.prompt_key"),
    (["policy.generation_backend=atom"], "policy.rollout_engine"),
    (["policy.rollout.fused_moe=on", "policy.rollout_engine=hf"], "policy.rollout.fused_moe"),
    (["policy.rollout.fused_moe=yes"], "policy.rollout.fused_moe"),
    (["policy.rollout.decode_linear=on", "policy.rollout_engine=hf"], "policy.rollout.decode_linear"),
    (["policy.rollout.pdl=false", "policy.rollout_engine=hf"], "policy.rollout.pdl"),
    (["policy.rollout.decode_linear=on", "policy.rollout.fuse_projections=false"], "policy.rollout.decode_linear"),
    (["policy.rollout.decode_linear=always"], "policy.rollout.decode_linear"),
    # config/scope.py: set while nothing reads them
    (["sddd.lr=0.1"], "sddd.lr"),
    (["trainer.name=sddd", "algorithm.name=sddd", "policy.optim.lr=0.1"], "policy.optim.lr"),
    (["trainer.name=sddd", "algorithm.name=sddd", "dataset.train_batch_size=4"], "dataset.train_batch_size"),
    (["trainer.name=sddd", "algorithm.name=sddd", "sddd.draft=dflash", "sddd.ttt_steps=3"], "sddd.ttt_steps"),
    (["trainer.name=sddd", "algorithm.name=sddd", "sddd.block_size=4"], "sddd.block_size"),
    (["trainer.name=sddd", "algorithm.name=sddd", "sddd.tcp_port=9000"], "sddd.tcp_port"),
    (["critic.value_loss_coef=1.0"], "critic.value_loss_coef"),
    (["policy.lora.alpha=8"], "policy.lora.alpha"),
    (["moe.r3.record_router_logits=true"], "moe.r3.record_router_logits"),
    (["quantization.training.recipe=rowwise"], "quantization.training.recipe"),
    (["quantization.rollout.fuse_mlp=true"], "quantization.rollout.fuse_mlp"),
    (["quantization.rollout.kv_scale_recalibration=false"], "quantization.rollout.kv_scale_recalibration"),
    (["quantization.rollout_correction.clip=3"], "quantization.rollout_correction.clip"),
    (["policy.rollout.speculative.num_draft_tokens=3"], "policy.rollout.speculative.num_draft_tokens"),
    (["algorithm.kl_loss_coef=0.01"], "algorithm.kl_loss_coef"),
    (["algorithm.kl_reward_coef=0.1"], "algorithm.kl_reward_coef"),
    (["algorithm.max_num_gen_batches=2"], "algorithm.max_num_gen_batches"),
    (["algorithm.overlong_penalty_factor=2"], "algorithm.overlong_penalty_factor"),
    (["reward.function=my_rewards:score", "reward.format_score=0.1"], "reward.format_score"),
    (["eval.every=5", "trainer.test_freq=3"], "trainer.test_freq"),
    (["eval.enabled=false", "eval.every=5"], "eval.every"),
    (["dataset.path=data/train.jsonl"], "dataset.path"),
    (["dataset.name=jsonl", "dataset.difficulty=3"], "dataset.difficulty"),
    (["controller.ray.num_workers=2"], "controller.ray.num_workers"),
    (["controller.name=ray", "controller.ray.rollout_workers=2"], "controller.ray.rollout_workers"),
    (["logger.backends=[jsonl]", "logger.log_every=5"], "logger.log_every"),
    (["logger.wandb_project=mine"], "logger.wandb_project"),
    (["quantization.rollout.precision=fp16"], "quantization.rollout.precision"),
    (["quantization.training.precision=fp32"], "quantization.training.precision"),
]


@pytest.mark.parametrize(("overrides", "key"), SILENT, ids=[" ".join(o) for o, _ in SILENT])
def test_silent_case_refused_at_load(overrides, key):
    errors = _problems(overrides)
    assert [e.key for e in errors] == [key]
    assert "\n" not in str(errors[0])


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has a GPU")
def test_missing_device_and_gpu_preset_refused():
    assert [e.key for e in _problems(["cluster.device=cuda"])] == ["cluster.device"]
    keys = {e.key for e in _problems([], CONFIGS / "grpo_dense_fp8_8gpu.yaml")}
    assert "cluster.device" in keys
    load_config(CONFIGS / "grpo_dense_fp8_8gpu.yaml", machine=False)  # inspectable with --skip-machine-checks


def test_all_problems_reported_at_once_one_line_each():
    overrides = ["policy.optim.lr=inf", "policy.rollout.n=1", "algorithm.clip_ratio_c=1",
                 "async_training.enabled=true", "critic.optim.lr=nan"]
    with pytest.raises(ConfigError) as info:  # nan is a type error of its own (raised while building)
        load_config(None, overrides)
    assert info.value.key == "critic.optim.lr"
    errors = _problems(overrides[:-1])
    assert sorted(e.key for e in errors) == sorted(
        ["policy.optim.lr", "policy.rollout.n", "algorithm.clip_ratio_c", "async_training.enabled"])
    assert len(str(ConfigProblems(errors)).splitlines()) == 4


def test_accepted_neighbours_of_refused_values():
    cfg = load_config(None, ["algorithm.clip_ratio_c=null", "eval.temperature=0", "policy.train.mini_batch_size=16",
                             "dataset.prompt_template={prompt}", "assembly.use_new_assembler=true"])
    assert cfg.algorithm.clip_ratio_c is None and cfg.dataset.prompt_template == "{prompt}"
    assert load_config(None, ["dataset.name=jsonl", "dataset.prompt_key='null'"]).dataset.prompt_key == "null"
    async_rl = ["trainer.name=async_rl", "async_training.enabled=true"]
    assert load_config(None, [*async_rl, "weight_sync.method=collective"]).weight_sync.method == "collective"
    load_config(None, [*async_rl, "weight_sync.method=filesystem", "weight_sync.snapshot_dir=/tmp/snap"])


def test_hub_id_accepted_only_from_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="policy.model_name"):
        load_config(None, ["policy.model_name=Qwen/Qwen3-8B"])
    snap = tmp_path / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert load_config(None, ["policy.model_name=Qwen/Qwen3-8B"]).policy.model_name == "Qwen/Qwen3-8B"
    local = tmp_path / "my_model"
    local.mkdir()
    assert load_config(None, [f"policy.model_name={local}"]).policy.model_name == str(local)


# ------------------------------------------------------------------ original LumenRL keys
def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


# original key=value -> {current key: expected value}; one case per original key
ORIGINAL = [
    ("policy.generation_backend=hf", {"policy.rollout_engine": "hf"}),
    ("policy.max_total_sequence_length=100", {"policy.rollout.max_new_tokens": 100 - 64}),
    ("policy.train_global_batch_size=16", {"policy.train.mini_batch_size": 16}),
    ("policy.train_micro_batch_size=2", {"policy.train.micro_batch_size": 2}),
    ("algorithm.grpo.num_generations=4", {"policy.rollout.n": 4}),
    ("algorithm.grpo.kl_coeff=0.01", {"algorithm.kl_loss_coef": 0.01, "algorithm.use_kl_loss": True}),
    ("algorithm.grpo.clip_ratio=0.25", {"algorithm.clip_ratio_low": 0.25, "algorithm.clip_ratio_high": 0.25}),
    ("algorithm.grpo.num_mini_batches=4", {"policy.train.mini_batch_size": 8 * 8 // 4}),
    ("algorithm.grpo.num_ppo_epochs=2", {"policy.train.ppo_epochs": 2}),
    ("quantization.rollout.num_first_layers_in_bf16=1", {"quantization.rollout.skip_first_n_layers": 1}),
    ("quantization.rollout.num_last_layers_in_bf16=2", {"quantization.rollout.skip_last_n_layers": 2}),
    ("quantization.training.fp8=e4m3", {"quantization.training.precision": "fp8",
                                        "quantization.training.fp8_format": "e4m3"}),
    ("quantization.training.fp8_recipe=tensorwise", {"quantization.training.recipe": "tensorwise"}),
    ("quantization.training.fp8_weight_cache=false", {"quantization.training.weight_cache": False}),
    ("quantization.rollout_correction.method=mis", {"quantization.rollout_correction.enabled": True,
                                                    "quantization.rollout_correction.mode": "mis_token"}),
    ("moe.r3.mode=replay", {"moe.r3.replay_mode": "hard_assignment"}),
    ("reward.type=countdown", {"reward.name": "countdown"}),
    ("reward.dataset=data/train.jsonl", {"dataset.name": "jsonl", "dataset.path": "data/train.jsonl"}),
    ("checkpointing.checkpoint_dir=runs/x", {"trainer.output_dir": "runs/x"}),
    ("checkpointing.save_steps=5", {"checkpointing.save_every": 5}),
    ("logger.wandb_enabled=true", {"logger.backends": ["jsonl", "console", "wandb"]}),
    ("logger.log_interval=3", {"logger.log_every": 3}),
    ("controller.ray.enabled=true", {"controller.name": "ray"}),
    ("assembly.use_new_assembler=true", {}),
]


def test_every_original_key_has_a_case():
    assert {text.partition("=")[0] for text, _ in ORIGINAL} >= set(LEGACY) - {"quantization.rollout.use_deep_gemm"}


# the switch an original key's setting needs to be read (config/scope.py refuses it otherwise)
ORIGINAL_CONTEXT = {"quantization.rollout.num_first_layers_in_bf16": ["quantization.rollout.precision=fp8"],
                    "quantization.rollout.num_last_layers_in_bf16": ["quantization.rollout.precision=fp8"],
                    "quantization.training.fp8_recipe": ["quantization.training.precision=fp8"],
                    "quantization.training.fp8_weight_cache": ["quantization.training.precision=fp8"]}


@pytest.mark.parametrize(("text", "expected"), ORIGINAL, ids=[t for t, _ in ORIGINAL])
def test_original_key_read_as_current(text, expected, caplog, monkeypatch):
    monkeypatch.setattr(legacy, "_NOTED", set())  # notes are logged once per process: another test may have read it
    with caplog.at_level("WARNING", logger="lumenrl.config"):
        cfg = load_config(None, [*ORIGINAL_CONTEXT.get(text.partition("=")[0], []), text])
    for key, value in expected.items():
        assert _get(cfg, key) == value
    key = text.partition("=")[0]
    assert any(key in r.getMessage() and "original LumenRL" in r.getMessage() for r in caplog.records) or not expected


def test_original_keys_in_a_yaml_file(tmp_path):
    path = tmp_path / "legacy.yaml"
    path.write_text(
        "policy:\n  generation_backend: native\n  train_micro_batch_size: 4\n"
        "algorithm:\n  grpo:\n    num_generations: 4\n    kl_coeff: 0.0\n"
        "quantization:\n  rollout:\n    precision: fp8\n    use_deep_gemm: true\n  rollout_correction:\n"
        "    method: tis\n    clip: 3.0\n"
        "moe:\n  r3:\n    record_router_logits: false\n"
        "cluster:\n  num_nodes: 1\n  gpus_per_node: 0\n"
        "controller:\n  ray:\n    enabled: false\n"
    )
    cfg = load_config(path, ["policy.rollout.n=8"])  # a later layer's current key still wins
    assert cfg.policy.rollout.n == 8 and cfg.policy.train.micro_batch_size == 4
    assert cfg.algorithm.use_kl_loss is False and cfg.quantization.rollout.scheme == "fp8_block"
    assert cfg.quantization.rollout_correction.mode == "tis_token" and cfg.quantization.rollout_correction.clip == 3.0


def test_original_keys_misused_are_refused_with_meaning():
    assert _problems(["quantization.rollout.use_deep_gemm=true"])[0].key == "quantization.rollout.use_deep_gemm"
    assert _problems(["quantization.training.fp8=yes"])[0].key == "quantization.training.fp8"
    ray = _problems(["controller.ray.actor.num_workers=4"])  # the actor role's pool is controller.ray.num_workers
    assert ray[0].key == "controller.ray.roles.actor.num_workers" and "must equal" in ray[0].problem
    atom = str(_problems(["policy.generation_backend=atom"])[0])
    assert "not installed" in atom and "native" in atom
    for value in (".inf", "-.inf", ".nan"):  # found by the fuzz test: int(inf) raised OverflowError
        (error,) = _problems([f"policy.max_total_sequence_length={value}"])
        assert error.key == "policy.max_total_sequence_length" and "positive integer" in str(error)


def test_misleading_hints_are_gone():
    for text in ("policy.generation_backend=native", "quantization.rollout.use_deep_gemm=false",
                 "checkpointing.checkpoint_dir=runs/a"):
        load_config(None, [text])  # read, not "did you mean training_backend / fuse_mlp / export_hf"


def test_builtin_names_checked_at_load_with_a_suggestion():
    from lumenrl_core.builtins import BUILTIN_MODELS

    (error,) = _problems(["policy.model_name=lumenrl:tiny-qwen3-arithm"])
    assert "did you mean 'lumenrl:tiny-qwen3-arith'" in str(error)
    for name in BUILTIN_MODELS:
        assert load_config(None, [f"policy.model_name=lumenrl:{name}"]).policy.model_name == f"lumenrl:{name}"


def test_type_range_and_unknown_key_errors_are_all_reported_at_once():
    overrides = ["policy.optim.lr=abc", "policy.rollout.n=zero", "policy.rollout.temprature=0.5",
                 "critic.optim.lr=nan", "policy.train.mini_batch_size=-3"]
    errors = _problems(overrides)
    assert sorted(e.key for e in errors) == sorted(["policy.optim.lr", "policy.rollout.n", "policy.rollout.temprature",
                                                    "policy.train.mini_batch_size", "critic.optim.lr"])
    assert all("\n" not in str(e) for e in errors)
    assert "did you mean" in str(errors[[e.key for e in errors].index("policy.rollout.temprature")])


def test_moe_features_refused_on_transformers_before_the_moe_layout():
    from lumenrl_core.assembly.requirements import _moe_layout_violations, moe_layout_supported

    cfg = load_config(None, ["moe.r3.enabled=true", "moe.expert_parallel_size=2", "policy.rollout.fused_moe=on"],
                      machine=False)
    old = _moe_layout_violations(cfg, installed="4.57.6")
    assert [v.key for v in old] == ["moe.r3.enabled", "moe.expert_parallel_size", "policy.rollout.fused_moe"]
    assert all("transformers>=5.13" in str(v) and "4.57.6" in str(v) for v in old)
    assert len(_moe_layout_violations(cfg, installed="5.12.0")) == 3  # DeepSeek-V3/GLM-4-MoE route in the block
    assert _moe_layout_violations(cfg, installed="5.13.0") == []
    assert moe_layout_supported("5.24.0") and not moe_layout_supported("4.57.6")


def test_settings_read_once_their_switch_is_on():
    load_config(None, ["trainer.name=sddd", "algorithm.name=sddd", "sddd.draft=dflash", "sddd.block_size=4"])
    load_config(None, ["critic.enabled=true", "critic.value_loss_coef=1.0", "quantization.training.precision=fp8",
                       "quantization.training.recipe=rowwise", "policy.dtype=float16",
                       "quantization.rollout.precision=fp16"])
    load_config(None, ["quantization.training.precision=fp32", "policy.train.mixed_precision=fp32"])
    load_config(None, ["dataset.name=jsonl", "dataset.path=data/train.jsonl", "logger.backends=[jsonl, wandb]",
                       "logger.wandb_project=mine", "eval.every=5"])


def test_a_later_layer_may_switch_a_feature_off(tmp_path, caplog):
    """A base file's critic settings under an override critic.enabled=false: switched off on purpose, logged."""
    base = tmp_path / "base.yaml"
    base.write_text("critic:\n  enabled: true\n  value_loss_coef: 1.0\ndataset:\n  difficulty: 1\n")
    run = tmp_path / "run.yaml"
    run.write_text("defaults: [base.yaml]\ndataset:\n  name: jsonl\n  path: data/train.jsonl\n")
    with caplog.at_level("WARNING", logger="lumenrl.config"):
        cfg = load_config(run, ["critic.enabled=false"])
    # the dead settings are reset to their defaults: the resolved config (output_dir/config.yaml) loads as one layer
    assert not cfg.critic.enabled and cfg.critic.value_loss_coef == 0.5 and cfg.dataset.difficulty == 2
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "critic.value_loss_coef" in logged and "dataset.difficulty" in logged and "reset to its default" in logged
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg
    # the same setting in the layer that switches it off (or later) is refused
    assert [e.key for e in _problems(["critic.enabled=false", "critic.value_loss_coef=2.0"], run)] == [
        "critic.value_loss_coef"]
    same = tmp_path / "same.yaml"
    same.write_text("critic:\n  value_loss_coef: 1.0\n")
    assert [e.key for e in _problems([], same)] == ["critic.value_loss_coef"]


def test_warm_start_is_for_builtin_demo_models(tmp_path):
    """The warm-start SFT runs on built-in lumenrl: models only: set in the same layer as a real model, refused."""
    errors = _problems([f"policy.model_name={tmp_path}", "trainer.warm_start_sft_steps=5"])
    assert [e.key for e in errors] == ["trainer.warm_start_sft_steps"] and "real checkpoint" in errors[0].problem
    assert load_config(None, ["trainer.warm_start_sft_steps=5"]).trainer.warm_start_sft_steps == 5  # built-in default
