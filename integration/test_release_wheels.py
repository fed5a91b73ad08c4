"""The release check (scripts/release_check.py) on the real packages, and on a copy it must refuse.

The full check builds all six sdists and wheels, installs each wheel alone in a fresh venv (torch
and the other declared third-party dependencies linked from this environment, siblings only from
the fresh wheels), imports it and runs its README example. The refusal test builds two packages
of a copied workspace whose versions were bumped without their ranges and changelog following.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scripts import release_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_release_check_passes_on_the_workspace(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "release_check.py"), "--dist", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    print(proc.stdout)  # the per-step timings, shown by --durations / -s
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "release check: 6 packages, 0 problems" in proc.stdout
    assert len(list((tmp_path / "dist").glob("*.whl"))) == 6
    assert len(list((tmp_path / "dist").glob("*.tar.gz"))) == 6


def _copy_package(name: str, dest: Path) -> Path:
    shutil.copytree(ROOT / "packages" / name, dest / name, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    return dest / name


def _set_version(package: Path, version: str) -> None:
    about = next(package.glob("src/*/__about__.py"))
    about.write_text(re.sub(r'__version__ = "[^"]+"', f'__version__ = "{version}"', about.read_text()))


def test_release_check_names_each_inconsistency(tmp_path):
    packages = tmp_path / "packages"
    core, moe = _copy_package("lumenrl-core", packages), _copy_package("lumenrl-moe", packages)
    _set_version(core, "0.2.0")  # lumenrl-moe still requires lumenrl-core<0.2
    _set_version(moe, "0.1.1")  # no CHANGELOG section for it
    problems, timings = release_check.check(release_check.discover([], packages), tmp_path / "work",
                                            static=True, packages_dir=packages)
    assert set(timings) == {"build lumenrl-core", "build lumenrl-moe"}
    assert len(problems) == 3, problems
    assert any(p.startswith("lumenrl-core 0.2.0: lumenrl-core/CHANGELOG.md has no '## [0.2.0]'") for p in problems)
    assert any(p.startswith("lumenrl-moe 0.1.1: lumenrl-moe/CHANGELOG.md has no '## [0.1.1]'") for p in problems)
    assert "lumenrl-moe 0.1.1: requires lumenrl-core>=0.1,<0.2, but lumenrl-core is now 0.2.0" in problems


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("hatch") is None, reason="hatch is not on PATH (pip install 'hatch>=1.16,<2')")
def test_hatch_build_all_builds_every_package_and_nothing_else(tmp_path):
    """``hatch build --all`` at the root: each member's sdist and wheel, and no artifact for the root."""
    # as from a shell: not inside `hatch run test:all`, whose active-environment variables would select `test`
    env = {k: v for k, v in os.environ.items() if not k.startswith("HATCH_ENV") and k != "VIRTUAL_ENV"}
    proc = subprocess.run(["hatch", "build", "--all", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    packages = release_check.discover([])
    expected = {f"{p.name.replace('-', '_')}-{p.version}{ext}" for p in packages
                for ext in ("-py3-none-any.whl", ".tar.gz")}
    assert len(packages) == 6 and {path.name for path in tmp_path.iterdir()} == expected
