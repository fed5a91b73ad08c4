"""lumenrl-backends refuses installed sibling packages outside the ranges it declares."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from lumenrl_core.plugins import IncompatibleSiblingsError, require_compatible_siblings

SIBLINGS = ("lumenrl-core", "lumenrl-quant", "lumenrl-moe", "lumenrl-sddd", "lumenrl-async")


def _declared() -> dict[str, Requirement]:
    reqs = (Requirement(line) for line in metadata.requires("lumenrl-backends") or [])
    return {r.name: r for r in reqs if r.name.startswith("lumenrl-") and r.marker is None}


def test_declares_a_capped_range_for_every_sibling():
    declared = _declared()
    assert set(declared) == set(SIBLINGS)
    for name, req in declared.items():
        current = metadata.version(name)
        assert req.specifier.contains(current), (req, current)
        major, minor = map(int, current.split(".")[:2])
        assert not req.specifier.contains(f"{major}.{minor + 1}.0"), f"{req} is not capped below the next minor"


def test_refuses_an_incompatible_sibling_with_one_line():
    """A fake installed lumenrl-quant from the next minor and a missing lumenrl-moe, through the seam."""
    real = {name: metadata.version(name) for name in ("lumenrl-backends", *SIBLINGS)}
    quant = _declared()["lumenrl-quant"]
    major, minor = map(int, real["lumenrl-quant"].split(".")[:2])
    fake = {**real, "lumenrl-quant": f"{major}.{minor + 1}.0", "lumenrl-moe": None}
    with pytest.raises(IncompatibleSiblingsError) as err:
        require_compatible_siblings("lumenrl-backends", installed=fake.get)
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    quant_line = next(line for line in lines if "lumenrl-quant" in line)
    assert quant_line.startswith(f"lumenrl-backends {real['lumenrl-backends']} requires lumenrl-quant")
    assert f"but lumenrl-quant {fake['lumenrl-quant']} is installed" in quant_line
    assert "pip install 'lumenrl-quant" in quant_line and all(str(s) in quant_line for s in quant.specifier)
    assert any("lumenrl-moe" in line and "not installed" in line for line in lines)


def test_the_installed_set_is_accepted_at_import():
    require_compatible_siblings("lumenrl-backends")  # the real installed versions: no error
    proc = subprocess.run([sys.executable, "-c", "import lumenrl_backends; print(lumenrl_backends.__version__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == metadata.version("lumenrl-backends")
