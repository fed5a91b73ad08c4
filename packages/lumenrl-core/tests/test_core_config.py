"""Tests for lumenrl_core.config: loading, overrides, inheritance, validation messages, dump round trip."""

from __future__ import annotations

import pickle
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lumenrl_core.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
    validate_config,
)
from lumenrl_core.config.typed import Builder


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path=None, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message and message == info.value.args[0]
    return info.value


# ----------------------------------------------------------------- good loads
def test_no_path_gives_schema_defaults():
    assert load_config(None, []) == RunConfig()
    assert load_config() == RunConfig()


def test_yaml_file_sets_nested_values_with_coercion(tmp_path):
    path = write(
        tmp_path / "run.yaml",
        """
        seed: 7
        policy:
          model_name: Qwen/Qwen3-8B
          optim:
            lr: 1e-6          # YAML 1.1 reads this as a string; the loader makes it a float
            weight_decay: 0   # int for a float field
            betas: [0.9, 0.95]
          rollout:
            stop_token_ids: [2, 7]
        quantization:
          rollout: {precision: fp8, kv_cache_dtype: fp8}
        trainer:
          experiment_name: 2024
        """,
    )
    cfg = load_config(path, [], machine=False)  # the hub id need not be cached here
    assert cfg.seed == 7 and cfg.policy.model_name == "Qwen/Qwen3-8B"
    assert cfg.policy.optim.lr == 1e-6 and isinstance(cfg.policy.optim.lr, float)
    assert cfg.policy.optim.weight_decay == 0.0 and isinstance(cfg.policy.optim.weight_decay, float)
    assert cfg.policy.optim.betas == [0.9, 0.95] and cfg.policy.rollout.stop_token_ids == [2, 7]
    assert cfg.quantization.rollout.precision == "fp8" and cfg.quantization.rollout.kv_cache_dtype == "fp8"
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.policy.rollout.n == RunConfig().policy.rollout.n  # untouched keys keep defaults


def test_empty_file_and_empty_section_keep_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", ""), []) == RunConfig()
    assert load_config(write(tmp_path / "sec.yaml", "policy:\n"), []) == RunConfig()


def test_section_default_factories_survive_partial_sections(tmp_path):
    cfg = load_config(None, ["critic.enabled=true", "critic.optim.weight_decay=0.1"])
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.weight_decay == 0.1


# ----------------------------------------------------------------- overrides
def test_override_precedence(tmp_path):
    path = write(tmp_path / "run.yaml", "num_training_steps: 5\npolicy:\n  optim:\n    lr: 0.001\n")
    cfg = load_config(path, ["policy.optim.lr=2e-5", "num_training_steps=9", "num_training_steps=11"])
    assert cfg.policy.optim.lr == 2e-5 and cfg.num_training_steps == 11


def test_override_values_are_yaml(tmp_path):
    cfg = load_config(
        None,
        [
            "policy.rollout.stop_token_ids=[1, 2, 3]",
            "logger.backends=[jsonl, tensorboard]",
            "assembly.strict_policy=false",
            "policy.optim.betas=[0, 0.5]",
            "quantization.rollout={precision: mxfp4, skip_first_n_layers: 2}",
        ],
    )
    assert cfg.policy.rollout.stop_token_ids == [1, 2, 3]
    assert cfg.logger.backends == ["jsonl", "tensorboard"] and cfg.assembly.strict_policy is False
    assert cfg.policy.optim.betas == [0.0, 0.5] and all(isinstance(b, float) for b in cfg.policy.optim.betas)
    assert cfg.quantization.rollout.precision == "mxfp4" and cfg.quantization.rollout.skip_first_n_layers == 2


def test_str_overrides_keep_the_typed_text():
    assert parse_override("trainer.experiment_name=0123") == ("trainer.experiment_name", "0123")
    assert parse_override("policy.tokenizer_name=") == ("policy.tokenizer_name", "")
    assert parse_override("reward.function=my.mod:score") == ("reward.function", "my.mod:score")
    assert parse_override("policy.model_name='a b'") == ("policy.model_name", "a b")
    assert load_config(None, ["policy.model_name=Qwen/Qwen3-8B"], machine=False).policy.model_name == "Qwen/Qwen3-8B"


# ----------------------------------------------------------------- errors
def test_misspelt_override_key_names_closest_key():
    err = error_of(None, ["policy.modle_name=Qwen/Qwen3-8B"])
    assert err.key == "policy.modle_name" and err.suggestion == "policy.model_name"
    assert "did you mean 'policy.model_name'?" in str(err) and "'Qwen/Qwen3-8B'" in str(err)
    assert "override 'policy.modle_name=Qwen/Qwen3-8B'" in str(err)
    assert error_of(None, ["polcy.optim.lr=1"]).suggestion == "policy.optim.lr"
    assert error_of(None, ["policy.lr=1"]).suggestion == "policy.optim.lr"  # leaf of a deeper section


def test_misspelt_yaml_key_names_closest_key_and_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "quantization:\n  rollout:\n    precison: fp8\n")
    err = error_of(path)
    assert err.key == "quantization.rollout.precison" and err.suggestion == "quantization.rollout.precision"
    assert f"file {path}" in str(err) and "precision, scheme" in str(err)


def test_wrong_types_name_key_value_and_type():
    err = error_of(None, ["dataset.train_batch_size=many"])
    assert str(err).startswith(
        "config key 'dataset.train_batch_size' = 'many': wrong type (str); allowed: int"
    )
    assert error_of(None, ["seed=true"]).allowed == "int"  # bools are not ints
    assert error_of(None, ["policy.optim.lr=2.5.1"]).allowed == "float"
    assert error_of(None, ["num_training_steps=2.5"]).allowed == "int"
    assert "written [a, b, ...]" in str(error_of(None, ["logger.backends=jsonl"]))
    assert error_of(None, ["policy.rollout.stop_token_ids=[1, x]"]).key == "policy.rollout.stop_token_ids[1]"
    assert error_of(None, ["policy=3"]).allowed.startswith("a section with keys model_name, tokenizer_name")
    assert "is a value, not a section" in str(error_of(None, ["seed.x=1"]))


def test_bad_choice_lists_choices_and_closest():
    err = error_of(None, ["quantization.rollout.precision=fp9"])
    assert err.allowed == "one of bf16, fp16, fp32, fp8, mxfp8, mxfp4" and err.suggestion == "fp8"
    assert "'fp9'" in str(err)


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("dataset.train_batch_size=0", "int >= 1"),
        ("policy.rollout.top_p=0", "float in (0, 1]"),
        ("algorithm.gamma=1.5", "float in [0, 1]"),
        ("policy.optim.eps=0", "float > 0"),
        ("async_training.staleness_threshold=-0.5", "float >= 0"),
    ],
)
def test_out_of_range_values(override, allowed):
    err = error_of(None, [override])
    assert err.key == override.split("=")[0] and err.allowed == allowed and "out of range" in str(err)


def test_cross_field_checks():
    assert error_of(None, ["policy.optim.betas=[0.9]"]).problem == "needs exactly 2 values"
    assert error_of(None, ["policy.optim.betas=[0.9, 1.0]"]).key == "policy.optim.betas[1]"
    err = error_of(
        None, ["quantization.rollout_correction.mask_low=2", "quantization.rollout_correction.mask_high=1"]
    )
    assert err.key == "quantization.rollout_correction.mask_high" and "mask_low (2.0)" in str(err)


def test_malformed_inputs(tmp_path):
    assert "must look like KEY=VALUE" in str(error_of(None, ["policy.model_name"]))
    assert "not valid YAML" in str(error_of(None, ["policy.rollout.stop_token_ids=[1, 2"]))
    bad_yaml = write(tmp_path / "bad.yaml", "policy:\n  model_name: [unclosed\n")
    assert "invalid YAML" in str(error_of(bad_yaml)) and "line" in str(error_of(bad_yaml))
    assert "top level must be a mapping" in str(error_of(write(tmp_path / "list.yaml", "- 1\n")))
    assert "cannot read config file" in str(error_of(tmp_path / "missing.yaml"))


def test_config_error_pickles():
    err = error_of(None, ["policy.modle_name=x"])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.suggestion == err.suggestion


# ------------------------------------------------------------ defaults: inheritance
def test_defaults_inheritance_chain(tmp_path):
    write(tmp_path / "base.yaml", "seed: 3\npolicy:\n  optim: {lr: 0.01, warmup_steps: 4}\n")
    write(
        tmp_path / "presets/fp8.yaml",
        "defaults: [../base.yaml]\nquantization:\n  rollout: {precision: fp8}\n",
    )
    child = write(
        tmp_path / "presets/run.yaml",
        "defaults:\n  - fp8.yaml\npolicy:\n  optim: {lr: 0.02}\n",
    )
    cfg = load_config(child, ["seed=5"])
    assert cfg.policy.optim.lr == 0.02 and cfg.policy.optim.warmup_steps == 4  # merged key by key
    assert cfg.quantization.rollout.precision == "fp8" and cfg.seed == 5


def test_defaults_errors_name_the_file(tmp_path):
    write(tmp_path / "base.yaml", "policy:\n  optim: {lrr: 1}\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\n")
    err = error_of(child)
    assert err.suggestion == "policy.optim.lr" and "base.yaml" in err.source
    missing = write(tmp_path / "m.yaml", "defaults: [nope.yaml]\n")
    assert "file not found" in str(error_of(missing))
    write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    assert "circular defaults" in str(error_of(tmp_path / "a.yaml"))


# ------------------------------------------------------------ dump / programmatic
def test_dump_then_load_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "policy.optim.lr=3e-7",
            "trainer.experiment_name=007",
            "logger.backends=[console]",
            "policy.rollout.stop_token_ids=[5]",
            "quantization.rollout.precision=mxfp8",
            "algorithm.clip_ratio_high=0.28",
            "policy.tokenizer_name=",
        ],
    )
    text = dump_config(cfg)
    assert "experiment_name: '007'" in text
    back = load_config(write(tmp_path / "dumped.yaml", text), [])
    assert back == cfg and config_to_dict(back) == config_to_dict(cfg)


def test_config_from_dict_and_validate_config():
    cfg = config_from_dict({"policy": {"rollout": {"n": 4}}})
    assert cfg.policy.rollout.n == 4
    bad = RunConfig()
    bad.dataset.train_batch_size = 0
    with pytest.raises(ConfigError, match=r"'dataset.train_batch_size' = 0: out of range; allowed: int >= 1"):
        validate_config(bad)


def test_builder_honours_range_metadata_and_optional_fields():
    @dataclass(kw_only=True, slots=True)
    class Extra:
        ratio: float = field(default=0.5, metadata={"ge": 0, "le": 1})
        name: str | None = None
        weights: dict[str, float] = field(default_factory=dict)

    built = Builder(Extra).build(Extra, {"ratio": 1, "name": None, "weights": {"a": 2}})
    assert built.ratio == 1.0 and built.name is None and built.weights == {"a": 2.0}
    with pytest.raises(ConfigError, match=r"'ratio' = 1.5: out of range; allowed: float in \[0, 1\]"):
        Builder(Extra).build(Extra, {"ratio": 1.5})
    with pytest.raises(ConfigError, match=r"'weights.a' = 'x': wrong type"):
        Builder(Extra).build(Extra, {"weights": {"a": "x"}})
