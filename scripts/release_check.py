"""Release check: build every package, install each one alone from its wheel, and check versions agree.

    python scripts/release_check.py [--dist DIR] [--only lumenrl-quant ...] [--static] [--no-link]
    hatch run release:check

1. Build: ``python -m build --no-isolation`` per package (the sdist, then the wheel *from the sdist*,
   so a file missing from the sdist fails here) into one directory.
2. Consistency (read from the built artifacts): ``__about__.__version__`` equals the wheel's and the
   sdist's version; ``CHANGELOG.md`` has a ``## [X.Y.Z]`` section for it; every requirement on a
   sibling package contains the sibling's current version and excludes its next minor (STYLE 4).
3. Clean install, per package: a fresh venv gets only that wheel, the wheels of the siblings it
   requires (named as files, so they can only come from this build, never an index or the source
   tree) and its declared third-party dependencies; then ``import lumenrl_x`` must give the built
   version from the venv (not an editable install), no sibling it does not require may be present,
   and the first ```python block of the package README runs (cwd: the repository root, so a path
   like ``configs/...`` in an example resolves).
   Declared third-party dependencies that this interpreter already has at a satisfying version are
   symlinked into the venv rather than installed again (``scripts/fresh_venv.py``); ``--no-link``
   installs all of them with pip instead.

Every problem is printed as one line (``package: problem``); the exit status is 1 if there was any.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fresh_venv  # noqa: E402  (beside this file)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES_DIR = ROOT / "packages"
CHANGELOG_SECTION = re.compile(r"^## \[([^\]]+)\]", re.M)
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@dataclass(slots=True)
class Package:
    """One distribution of the workspace and what was built from it."""

    name: str
    path: Path
    import_name: str
    version: str  # from __about__.py
    wheel: Path | None = None
    sdist: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def _about_version(path: Path) -> str:
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", path.read_text(), re.M)
    if not match:
        raise SystemExit(f"{path}: no __version__ = '...' line")
    return match.group(1)


def discover(only: list[str], packages_dir: Path = PACKAGES_DIR) -> list[Package]:
    """Every ``packages/*/pyproject.toml`` (or the ``only`` ones), with its ``__about__`` version."""
    found = []
    for pyproject in sorted(packages_dir.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = data["project"]["name"]
        about = pyproject.parent / data["tool"]["hatch"]["version"]["path"]
        found.append(Package(name, pyproject.parent, about.parent.name, _about_version(about)))
    unknown = set(only) - {p.name for p in found}
    if unknown:
        raise SystemExit(f"--only: no package {sorted(unknown)}; packages: {', '.join(p.name for p in found)}")
    return [p for p in found if not only or p.name in only]


# ------------------------------------------------------------------------------------------ build


def build(package: Package, dist: Path) -> str | None:
    """Build the sdist, then the wheel from it, into ``dist``; record the files; a problem or None."""
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(package.path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
        return f"build failed: {' '.join(tail)}"
    stem = canonicalize_name(package.name).replace("-", "_")
    package.wheel = next(iter(sorted(dist.glob(f"{stem}-*.whl"))), None)
    package.sdist = next(iter(sorted(dist.glob(f"{stem}-*.tar.gz"))), None)
    return None if package.wheel and package.sdist else f"build left no wheel/sdist in {dist}"


def wheel_metadata(wheel: Path) -> email.message.Message:
    """The ``METADATA`` of a wheel (its Version, Requires-Dist, ...)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def runtime_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist without extras-only ones."""
    reqs = [Requirement(line) for line in wheel_metadata(wheel).get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


# ------------------------------------------------------------------------------------ consistency


def _req_text(req: Requirement) -> str:
    """``lumenrl-core>=0.1,<0.2``: lower bounds first, as pyproject.toml writes the ranges."""
    specs = sorted(req.specifier, key=lambda s: (s.operator.startswith("<"), str(s)))
    return f"{req.name}{','.join(str(s) for s in specs)}"


def _next_minor(version: str) -> Version:
    major, minor = (Version(version).release + (0, 0))[:2]
    return Version(f"{major}.{minor + 1}.0")


def consistency_problems(package: Package, siblings: dict[str, Package]) -> list[str]:
    """Versions of __about__, wheel, sdist and CHANGELOG agree; sibling ranges hold the current version."""
    problems = []
    built = wheel_metadata(package.wheel)["Version"]
    if built != package.version:
        problems.append(f"wheel says version {built}, __about__.py says {package.version}")
    if f"-{package.version}.tar.gz" not in package.sdist.name:
        problems.append(f"sdist {package.sdist.name} is not version {package.version}")
    changelog = package.path / "CHANGELOG.md"
    sections = CHANGELOG_SECTION.findall(changelog.read_text()) if changelog.is_file() else []
    if package.version not in sections:
        problems.append(f"{package.path.name}/CHANGELOG.md has no '## [{package.version}]' section "
                        f"(sections: {', '.join(sections) or 'none'})")
    for req in runtime_requirements(package.wheel):
        sibling = siblings.get(canonicalize_name(req.name))
        if sibling is None:
            continue
        if not req.specifier.contains(sibling.version, prereleases=True):
            problems.append(f"requires {_req_text(req)}, but {sibling.name} is now {sibling.version}")
        elif req.specifier.contains(_next_minor(sibling.version), prereleases=True):
            cap = _next_minor(sibling.version)
            problems.append(f"requires {_req_text(req)}: not capped below {sibling.name}'s next minor "
                            f"(STYLE 4: add '<{cap.major}.{cap.minor}')")
    return problems


# --------------------------------------------------------------------------------- clean install


def sibling_closure(package: Package, siblings: dict[str, Package]) -> list[Package]:
    """The siblings ``package`` requires, transitively (read from the built wheels)."""
    found: dict[str, Package] = {}
    todo = [package]
    while todo:
        for req in runtime_requirements(todo.pop().wheel):
            key = canonicalize_name(req.name)
            if key in siblings and key not in found:
                found[key] = siblings[key]
                todo.append(siblings[key])
    return list(found.values())


def third_party_requirements(packages: list[Package], siblings: dict[str, Package]) -> list[str]:
    """Declared requirements of ``packages`` on anything but a sibling, plus the torch pin."""
    lines = [fresh_venv.TORCH_PIN]
    for package in packages:
        lines += [str(r) for r in runtime_requirements(package.wheel) if canonicalize_name(r.name) not in siblings]
    return lines


_PROBE = """
import importlib, importlib.metadata as md, json, sys
mod = importlib.import_module(sys.argv[1])
lumenrl = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("lumenrl"))
print(json.dumps({"version": mod.__version__, "file": mod.__file__, "lumenrl": lumenrl}))
"""


def _venv_env(env_dir: Path) -> dict[str, str]:
    """This environment without PYTHONPATH; built-in models go to a cache inside the venv, not the user's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["LUMENRL_CACHE"] = str(env_dir / "lumenrl-cache")
    return env


def _probe_problems(package: Package, python: Path, env_dir: Path, expected: set[str]) -> list[str]:
    proc = subprocess.run([str(python), "-c", _PROBE, package.import_name], capture_output=True, text=True,
                          timeout=300, cwd=env_dir, env=_venv_env(env_dir))
    if proc.returncode != 0:
        return [f"import {package.import_name} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    if found["version"] != package.version:
        problems.append(f"{package.import_name}.__version__ is {found['version']} in the installed wheel")
    if not Path(found["file"]).resolve().is_relative_to(env_dir.resolve()):
        problems.append(f"{package.import_name} imported from {found['file']}, not from the fresh venv")
    if set(found["lumenrl"]) != expected:
        problems.append(f"the venv holds {found['lumenrl']}, expected exactly {sorted(expected)}")
    return problems


def _readme_problems(package: Package, python: Path, env_dir: Path) -> list[str]:
    blocks = PYTHON_BLOCK.findall((package.path / "README.md").read_text())
    if not blocks:
        return [f"{package.path.name}/README.md has no ```python example block"]
    script = env_dir / "readme_example.py"
    script.write_text(blocks[0])
    proc = subprocess.run([str(python), str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=_venv_env(env_dir))
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return [f"the first ```python block of its README failed: {last}"]
    return []


def _install(package: Package, siblings: dict[str, Package], env_dir: Path, link: bool) -> list[str]:
    """A fresh venv at ``env_dir`` with ``package``'s wheel, its siblings' wheels and its third-party deps."""
    shutil.rmtree(env_dir, ignore_errors=True)
    python = fresh_venv.create(env_dir)
    needed = sibling_closure(package, siblings)
    third_party = third_party_requirements([package, *needed], siblings)
    missing, pins = fresh_venv.link_distributions(fresh_venv.site_packages(python), third_party) if link \
        else (third_party, [])
    wheels = [str(p.wheel) for p in (package, *needed)]
    proc = fresh_venv.pip_install(python, ["--find-links", str(package.wheel.parent), *wheels, *missing, *pins])
    if proc.returncode != 0:
        return [f"pip install of its wheel failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"]
    return []


def install_problems(
    package: Package, siblings: dict[str, Package], work: Path, link: bool, timings: dict[str, float]
) -> list[str]:
    """Install ``package`` alone into a fresh venv, then its smoke import, then its README example."""
    env_dir, label = work / f"venv-{package.name}", f"install {package.name}"
    python = env_dir / "bin" / "python"
    expected = {p.name for p in (package, *sibling_closure(package, siblings))}
    return (_timed(f"{label}: venv + pip", timings, _install, package, siblings, env_dir, link)
            or _timed(f"{label}: import", timings, _probe_problems, package, python, env_dir, expected)
            or _timed(f"{label}: README example", timings, _readme_problems, package, python, env_dir))


# ------------------------------------------------------------------------------------------- main


def _timed(label: str, timings: dict[str, float], fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        timings[label] = time.perf_counter() - start


def check(
    packages: list[Package], work: Path, *, static: bool = False, link: bool = True, packages_dir: Path = PACKAGES_DIR
) -> tuple[list[str], dict[str, float]]:
    """Check ``packages`` (every package of ``packages_dir`` is built: siblings come from this build);
    return the problems (``"name version: problem"``) and the seconds each step took."""
    everyone = {canonicalize_name(p.name): p for p in discover([], packages_dir)}
    chosen = [key for key in everyone if key in {canonicalize_name(p.name) for p in packages}]
    dist, timings, problems = work / "dist", {}, []
    shutil.rmtree(dist, ignore_errors=True)
    for package in everyone.values():
        problem = _timed(f"build {package.name}", timings, build, package, dist)
        if problem:
            problems.append(f"{package.label}: {problem}")
    if problems:
        return problems, timings
    for key in chosen:
        problems += [f"{everyone[key].label}: {p}" for p in consistency_problems(everyone[key], everyone)]
    for key in [] if static else chosen:
        package = everyone[key]
        found = install_problems(package, everyone, work, link, timings)
        problems += [f"{package.label}: {p}" for p in found]
    return problems, timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", type=Path, help="keep the built wheels and venvs under this directory")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="check only these packages")
    parser.add_argument("--static", action="store_true", help="build and check versions; install nothing")
    parser.add_argument("--no-link", dest="link", action="store_false",
                        help="install every third-party dependency with pip (no symlinks from this interpreter)")
    args = parser.parse_args(argv)
    packages = discover(args.only)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lumenrl-release-") as tmp:
        work = args.dist.resolve() if args.dist else Path(tmp)
        problems, timings = check(packages, work, static=args.static, link=args.link)
    for label, seconds in timings.items():
        print(f"{label}: {seconds:.1f} s")
    print(f"release check: {len(packages)} packages, {len(problems)} problems, {time.perf_counter() - start:.1f} s")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
