"""Issue #16 property: random corruptions of every preset either load or are refused with ConfigError
lines, through the CLI's own entry point (``lumenrl config show``); none reaches a traceback. (Here, not in
lumenrl-core's tests: it drives lumenrl-backends' CLI, and core's tests also run alone, in ``iso-core``.)"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lumenrl_backends.cli import main
from lumenrl_core.config import RunConfig
from lumenrl_core.config.legacy import LEGACY
from lumenrl_core.config.typed import all_keys

PRESETS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
KEYS = [*all_keys(RunConfig), *LEGACY, "controller.ray.actor.num_workers"]  # original LumenRL keys too
VALUES = st.sampled_from([float("inf"), float("-inf"), float("nan"), 0, -1, 10**18, 1e308, None, [], [1, "a"],
                          {}, {"a": 1}, "", "x", True, "1e-6", "null"])


def _typo(key: str, i: int) -> str:
    parts = key.split(".")
    last = parts[-1]
    j = i % max(len(last), 1)
    parts[-1] = last[:j] + last[j + 1:] + "x"
    return ".".join(parts)


@st.composite
def corruption(draw) -> tuple[Path, list[str]]:
    preset = draw(st.sampled_from(PRESETS))
    overrides = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS))
        if draw(st.integers(0, 4)) == 0:
            key = _typo(key, draw(st.integers(0, 20)))
        value = draw(VALUES)
        overrides.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    return preset, overrides


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=corruption())
def test_corrupted_presets_load_or_refuse_in_lines(case):
    preset, overrides = case
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["config", "show", "--config", str(preset), *overrides])  # an exception here fails the test
    assert rc in (0, 2)
    lines = err.getvalue().splitlines()
    lines = [line for line in lines if not line.startswith("note: ")]  # original-key notes
    if rc == 2:
        assert lines and all(line.startswith("lumenrl config: error: config") for line in lines), err.getvalue()
        assert "Traceback" not in err.getvalue()
    else:
        assert yaml.safe_load(out.getvalue())["seed"] is not None
