"""Every plugin LumenRL ships is declared by a torch-free spec (``<package>.plugin_manifest``) that
its entry point names and that agrees with the class: same capabilities and requirements, same probe answer."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from lumenrl_core.plugins import KINDS, PluginRegistry, group_of
from lumenrl_core.plugins.spec import as_spec

REGISTRY = PluginRegistry()
DISTRIBUTIONS = {f"lumenrl-{p}" for p in ("core", "quant", "moe", "sddd", "async", "backends")}  # not a third
# party's lumenrl-* plugin package installed beside them (examples/plugin_package)
SHIPPED = [(kind, name) for kind in KINDS for name in REGISTRY.names(kind)
           if REGISTRY.distribution(kind, name)[0] in DISTRIBUTIONS]
MANIFESTS = [f"lumenrl_{p}.plugin_manifest" for p in ("core", "quant", "moe", "sddd", "async", "backends")]


def _entry_point(kind: str, name: str) -> importlib.metadata.EntryPoint:
    return next(ep for ep in importlib.metadata.entry_points(group=group_of(kind)) if ep.name == name)


@pytest.mark.parametrize(("kind", "name"), SHIPPED, ids=[f"{k}/{n}" for k, n in SHIPPED])
def test_entry_point_names_a_spec_that_agrees_with_its_class(kind, name):
    entry_point = _entry_point(kind, name)
    assert entry_point.module.endswith(".plugin_manifest") and as_spec(entry_point.load()) is not None
    spec, cls = REGISTRY.spec(kind, name), REGISTRY.load(kind, name)
    assert spec.load() is cls
    assert frozenset(cls.capabilities) == spec.capabilities, f"{spec.target} declares other capabilities"
    assert frozenset(getattr(cls, "requires", ())) == spec.requires, f"{spec.target} declares other requirements"
    assert cls.probe() == spec.unavailable_reason() == REGISTRY.info(kind, name).reason


def test_every_lumenrl_distribution_ships_plugins():
    assert {REGISTRY.distribution(k, n)[0] for k, n in SHIPPED} == DISTRIBUTIONS


def test_manifests_import_no_torch():
    code = f"import importlib, sys\nfor m in {MANIFESTS!r}:\n    importlib.import_module(m)\nprint('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
