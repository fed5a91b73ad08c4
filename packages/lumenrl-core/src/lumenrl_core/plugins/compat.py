"""Compatibility of a LumenRL distribution with the installed sibling packages, checked *before*
any plugin code is imported (the approach of opentelemetry-python-contrib's ``dependencies.py``):
read the distribution's declared requirements from its metadata (``Requires-Dist``), keep those on
a sibling (a ``lumenrl-*`` distribution) that apply without extras, and test each installed
sibling's version against the declared specifier.

The plugin registry runs this for every plugin distribution before it imports plugin code, and
``lumenrl_backends`` runs :func:`require_compatible_siblings` at import, so an incompatible set of
installed packages is refused with one line per sibling that names the installed version and the
``pip install`` that fixes it.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable, Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = [
    "CORE_DISTRIBUTION",
    "SIBLING_PREFIX",
    "IncompatibleSiblingsError",
    "core_version",
    "core_requirement_problem",
    "installed_version",
    "require_compatible_siblings",
    "sibling_requirement_problems",
]

CORE_DISTRIBUTION = "lumenrl-core"
SIBLING_PREFIX = "lumenrl-"  # the distributions released from this repository


class IncompatibleSiblingsError(ImportError):
    """An installed LumenRL package is outside the range another one declares."""


def installed_version(distribution: str) -> str | None:
    """Installed version of ``distribution`` from its metadata, ``None`` if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def core_version() -> str:
    """Installed version of lumenrl-core (metadata, falling back to ``__about__``)."""
    found = installed_version(CORE_DISTRIBUTION)
    if found is None:
        from lumenrl_core.__about__ import __version__

        return __version__
    return found


def _runtime_requirements(requires: Iterable[str], names: Callable[[str], bool]) -> list[Requirement]:
    """The parseable requirements whose name passes ``names`` and that apply without extras."""
    found = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if not names(canonicalize_name(req.name)):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # only needed for an optional extra
        found.append(req)
    return found


def _spec_text(req: Requirement) -> str:
    """``name>=0.1,<0.2``: lower bounds first, as the ranges are written in pyproject.toml."""
    specs = sorted(req.specifier, key=lambda s: (s.operator.startswith("<"), str(s)))
    return f"{canonicalize_name(req.name)}{','.join(str(s) for s in specs)}"


def _problem(distribution: str, dist_version: str, req: Requirement, installed: str | None) -> str | None:
    wanted = _spec_text(req)
    if installed is None:
        return f"{distribution} {dist_version} requires {wanted} but it is not installed (pip install '{wanted}')"
    try:
        version = Version(installed)
    except InvalidVersion:
        return None  # a local build with a non-PEP 440 version: nothing to compare
    if req.specifier.contains(version, prereleases=True):
        return None
    return (f"{distribution} {dist_version} requires {wanted} but {canonicalize_name(req.name)} {installed} "
            f"is installed (pip install '{wanted}')")


def sibling_requirement_problems(
    distribution: str,
    dist_version: str,
    requires: Iterable[str],
    installed: Callable[[str], str | None] = installed_version,
) -> list[str]:
    """One line per sibling requirement of ``distribution`` that the installed sibling does not meet.

    ``requires`` are the distribution's ``Requires-Dist`` lines; ``installed(name)`` gives a
    sibling's installed version or ``None`` (the seam tests use). A requirement on the
    distribution itself is ignored."""
    own = canonicalize_name(distribution)
    reqs = _runtime_requirements(requires, lambda name: name.startswith(SIBLING_PREFIX) and name != own)
    found = (_problem(distribution, dist_version, r, installed(canonicalize_name(r.name))) for r in reqs)
    return [p for p in found if p]


def core_requirement_problem(
    distribution: str, dist_version: str, requires: Iterable[str], installed_core: str | None = None
) -> str | None:
    """``None`` if ``distribution``'s requirement on lumenrl-core accepts the installed core, else why not.

    A distribution that does not declare lumenrl-core (e.g. lumenrl-quant) is compatible."""
    core = [line for line in requires if _runtime_requirements([line], lambda n: n == CORE_DISTRIBUTION)]
    problems = sibling_requirement_problems(distribution, dist_version, core,
                                            lambda _name: installed_core or core_version())
    return problems[0] if problems else None


def require_compatible_siblings(
    distribution: str, installed: Callable[[str], str | None] = installed_version
) -> None:
    """Raise :class:`IncompatibleSiblingsError` (one line per problem) when an installed sibling is
    outside the range ``distribution`` declares; nothing to check when ``distribution`` itself has
    no installed metadata (its source on ``sys.path``)."""
    version = installed(distribution)
    if version is None:
        return
    problems = sibling_requirement_problems(distribution, version, metadata.requires(distribution) or [], installed)
    if problems:
        raise IncompatibleSiblingsError("\n".join(problems))
