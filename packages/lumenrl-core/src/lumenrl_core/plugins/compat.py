"""Compatibility of a plugin distribution with the installed ``lumenrl-core``, checked *before*
any plugin code is imported (the approach of opentelemetry-python-contrib's ``dependencies.py``):
read the distribution's declared requirements from its metadata and test the installed core
version against the specifier it declares for ``lumenrl-core``.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = ["CORE_DISTRIBUTION", "core_version", "core_requirement_problem"]

CORE_DISTRIBUTION = "lumenrl-core"


def core_version() -> str:
    """Installed version of lumenrl-core (metadata, falling back to ``__about__``)."""
    try:
        return metadata.version(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        from lumenrl_core.__about__ import __version__

        return __version__


def _core_requirements(requires: Iterable[str]) -> list[Requirement]:
    found = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != CORE_DISTRIBUTION:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # only needed for an optional extra
        found.append(req)
    return found


def core_requirement_problem(
    distribution: str, dist_version: str, requires: Iterable[str], installed_core: str | None = None
) -> str | None:
    """``None`` if ``distribution``'s requirement on lumenrl-core accepts the installed core, else why not.

    ``requires`` are the distribution's ``Requires-Dist`` lines. A distribution that does not
    declare lumenrl-core (e.g. lumenrl-quant, which depends on torch only) is compatible.
    """
    if canonicalize_name(distribution) == CORE_DISTRIBUTION:
        return None
    installed = installed_core or core_version()
    try:
        version = Version(installed)
    except InvalidVersion:
        return None
    for req in _core_requirements(requires):
        if not req.specifier.contains(version, prereleases=True):
            return (
                f"{distribution} {dist_version} requires {CORE_DISTRIBUTION}{req.specifier} "
                f"but {CORE_DISTRIBUTION} {installed} is installed"
            )
    return None
