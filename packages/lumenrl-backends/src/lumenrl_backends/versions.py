"""Installed versions of LumenRL's distributions and its key dependencies, read from their metadata.

Shown by ``lumenrl plugins`` and ``lumenrl --version`` and recorded in every run's ``plugins.json``.
"""

from __future__ import annotations

import importlib.metadata as metadata

__all__ = ["LUMENRL_DISTRIBUTIONS", "DISTRIBUTIONS", "package_versions", "versions_line"]

LUMENRL_DISTRIBUTIONS = (
    "lumenrl-core",
    "lumenrl-quant",
    "lumenrl-moe",
    "lumenrl-sddd",
    "lumenrl-async",
    "lumenrl-backends",
)
DISTRIBUTIONS = (*LUMENRL_DISTRIBUTIONS, "torch", "transformers")


def package_versions(names: tuple[str, ...] = DISTRIBUTIONS) -> dict[str, str | None]:
    """``{distribution: installed version or None}`` for ``names``."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def versions_line() -> str:
    """``lumenrl-core 0.1.0, lumenrl-quant 0.1.0, ...`` (``not installed`` for an absent one)."""
    return ", ".join(f"{name} {version or 'not installed'}"
                     for name, version in package_versions(LUMENRL_DISTRIBUTIONS).items())
