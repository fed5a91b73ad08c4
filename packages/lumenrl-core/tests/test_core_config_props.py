"""Hypothesis: random valid configs survive dump -> load, and override text round-trips scalar values."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, get_args, get_origin

from hypothesis import given, reject, settings
from hypothesis import strategies as st

from lumenrl_core.config import ConfigError, RunConfig, config_from_dict, dump_config, load_config
from lumenrl_core.config.errors import ConfigProblems
from lumenrl_core.config.refusals import NOT_YET_BUILT
from lumenrl_core.config.rules import field_range
from lumenrl_core.config.typed import all_keys, fields_of, section_type

SETTINGS = settings(max_examples=int(os.environ.get("LUMENRL_HYPOTHESIS_EXAMPLES", "30")), deadline=None)
TEXT = st.text(max_size=8)


def _leaf_specs() -> list[tuple[str, type, Any]]:
    """(dotted key, owning dataclass, FieldSpec) for every non-section field of RunConfig."""
    out = []
    for key in all_keys(RunConfig):
        *parents, name = key.split(".")
        cls = RunConfig
        for part in parents:
            cls = section_type(fields_of(cls)[part].type)
        spec = fields_of(cls)[name]
        if section_type(spec.type) is None:
            out.append((key, cls, spec))
    return out


# keys whose valid values depend on other keys or on the machine (checked by config/semantic.py and
# config/refusals.py, tested in test_core_config_refused.py): left at their defaults here
_COUPLED = {"policy.train.mini_batch_size", "policy.rollout.n", "policy.rollout.temperature",
            "algorithm.clip_ratio_c", "algorithm.overlong_buffer_len", "quantization.rollout.scheme",
            "policy.rollout_engine", "cluster.device", "cluster.gpus_per_node",
            "controller.ray.roles"}  # roles: per-role dicts checked against num_workers (test_core_config_refused.py)
# sections whose keys are checked together at load (async modes and their weight sync, R3, SDDD, Ray pools,
# meshes, speculative decoding, trainer/algorithm pairs): their coupled values are tested in
# test_core_config_refused.py
_COUPLED_PREFIXES = ("async_training.", "weight_sync.method", "weight_sync.snapshot_dir", "moe.", "sddd.", "controller.", "cluster.", "policy.parallel.",
                     "policy.rollout.speculative.", "policy.rollout.tensor_parallel_size", "algorithm.name",
                     "trainer.name")
LEAVES = [leaf for leaf in _leaf_specs()
          if leaf[0] not in _COUPLED and leaf[0] not in NOT_YET_BUILT and not leaf[0].startswith(_COUPLED_PREFIXES)]


def _number(kind: type, rng) -> st.SearchStrategy:
    lo = None if rng is None else rng.ge if rng.ge is not None else rng.gt
    hi = None if rng is None else rng.le if rng.le is not None else rng.lt
    if kind is int:
        lo = -(10**6) if lo is None else math.ceil(lo + (rng.gt is not None and rng.ge is None))
        return st.integers(lo, lo + 10**6 if hi is None else int(hi))
    return st.floats(
        min_value=-1e6 if lo is None else lo,
        max_value=1e6 if hi is None else hi,
        exclude_min=rng is not None and rng.gt is not None and rng.ge is None,
        exclude_max=rng is not None and rng.lt is not None and rng.le is None,
        allow_nan=False,
        allow_infinity=False,
    )


def _value(cls: type, spec) -> st.SearchStrategy:
    if "choices" in spec.metadata:
        return st.sampled_from(spec.metadata["choices"])
    rng = field_range(cls, spec.name, spec.metadata)
    tp = spec.type
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        items = TEXT if item is str else _number(item, rng)
        return (
            st.lists(items, min_size=2, max_size=2) if spec.name == "betas" else st.lists(items, max_size=3)
        )
    if tp is bool:
        return st.booleans()
    if tp is str:
        return TEXT
    return _number(tp, rng)


@st.composite
def config_data(draw) -> dict:
    data: dict = {}
    for key, cls, spec in LEAVES:
        if draw(st.booleans()):
            continue  # keep the default
        node = data
        *parents, name = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = draw(_value(cls, spec))
    return data


def _drop(data: dict, key: str) -> None:
    *parents, name = key.split(".")
    node = data
    for part in parents:
        node = node.get(part, {})
    node.pop(name, None)


def _load_in_scope(data: dict) -> RunConfig:
    """``config_from_dict(data)``, with the keys set while their feature is off (config/scope.py: refused, tested in
    test_core_config_refused.py) put back to their defaults: what is left round-trips."""
    for _ in range(4):
        try:
            return config_from_dict(data, machine=False)
        except ConfigProblems as exc:
            errors = exc.errors
        except ConfigError as exc:
            errors = [exc]
        if not all(e.problem.startswith("has no effect: ") for e in errors):
            raise ConfigProblems(errors) if len(errors) > 1 else errors[0]
        for e in errors:
            _drop(data, e.key)
    return config_from_dict(data, machine=False)


@SETTINGS
@given(data=config_data())
def test_random_valid_configs_round_trip_through_yaml(data):
    try:
        cfg = _load_in_scope(data)
    except ConfigError as exc:
        # cross-field constraints not encoded in the strategy
        errors = exc.errors if isinstance(exc, ConfigProblems) else [exc]
        if all("MIS band" in e.problem or "router probabilities" in e.problem or e.key in (
                "policy.rollout.exact_logprobs", "policy.rollout.fused_moe", "algorithm.old_log_probs",
                "policy.rollout.decode_linear", "policy.rollout.pdl", "quantization.rollout.precision",
                "quantization.training.precision", "policy.train.group_projections", "async_training.resume_kv")
               or e.problem.startswith("has no effect: ") for e in errors):
            reject()
        raise
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cfg.yaml"
        path.write_text(dump_config(cfg), encoding="utf-8")
        assert load_config(path, [], machine=False) == cfg


@SETTINGS
@given(name=TEXT, lr=_number(float, field_range(RunConfig, "lr", {"ge": 0})), steps=st.integers(0, 10**9))
def test_override_text_round_trips_scalars(name, lr, steps):
    overrides = [f"trainer.experiment_name={name}", f"policy.optim.lr={lr!r}", f"num_training_steps={steps}"]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as exc:
        if exc.key == "trainer.experiment_name" and "wrong type" in exc.problem:
            reject()  # null, a YAML list or mapping typed into a str field: refused on purpose
        raise
    stripped = name.strip()
    if not (len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\""):
        assert cfg.trainer.experiment_name == stripped  # str fields take the text as typed
    assert cfg.policy.optim.lr == lr and cfg.num_training_steps == steps
