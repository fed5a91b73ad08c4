"""Availability probes that plugin specs (``plugin_manifest`` modules) run.

A probe returns ``None`` when the plugin can run here, otherwise a one-line reason. Import
names are not trusted: PyPI has unrelated packages named ``lumen`` and ``atom`` that shadow
AMD's libraries, so :func:`module_probe` checks that the real API (named attributes) exists.

    ATOM = PluginSpec("lumenrl_x.engines:AtomEngine", {"logprobs"},
                      probe=lambda: module_probe("atom", ["LLMEngine", "SamplingParams"]) or cuda_probe())

Probes of plugins that a CPU preset names must not import torch: :func:`module_installed` answers
from the installed files where :func:`importlib.util.find_spec` would import the parent packages.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["module_probe", "module_installed", "cuda_probe", "first_reason"]


def _find(import_name: str) -> bool:
    try:
        return importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):
        return False  # a parent package is missing or broken


def _resolve(module: object, dotted: str) -> bool:
    """Whether ``module.<dotted>`` exists (importing submodules along the path if needed)."""
    obj = module
    path = getattr(module, "__name__", "")
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            path = f"{path}.{part}"
            continue
        try:
            obj = importlib.import_module(f"{path}.{part}")
        except Exception:  # noqa: BLE001 - any failure means the attribute is absent
            return False
        path = f"{path}.{part}"
    return True


def module_probe(import_name: str, required_attrs: Sequence[str] = (), *, install: str | None = None) -> str | None:
    """Import ``import_name`` and check that every name in ``required_attrs`` exists on it.

    ``required_attrs`` may be dotted (``"engine.TransferEngine"``). Returns ``None`` when the
    module and its API are present; otherwise the reason: not installed (with ``install``, the
    pip requirement to suggest), failed to import, or a namesake package lacking the API.
    """
    hint = f" (pip install {install})" if install else ""
    if not _find(import_name):
        return f"module {import_name!r} is not installed{hint}"
    try:
        module = importlib.import_module(import_name)
    except Exception as exc:  # noqa: BLE001 - broken installs raise anything
        return f"module {import_name!r} failed to import: {type(exc).__name__}: {exc}"
    missing = [attr for attr in required_attrs if not _resolve(module, attr)]
    if missing:
        where = getattr(module, "__file__", None) or "namespace package"
        return (
            f"module {import_name!r} at {where} lacks {', '.join(missing)}: "
            f"an unrelated package with the same import name?{hint}"
        )
    return None


def module_installed(dotted: str) -> bool:
    """Whether pure-Python module ``dotted`` is installed, read from its top-level package's files:
    nothing is imported (``find_spec("torch.distributed.fsdp")`` would import torch)."""
    top, *rest = dotted.split(".")
    if not _find(top):
        return False
    if not rest:
        return True
    for root in importlib.util.find_spec(top).submodule_search_locations or ():
        base = Path(root, *rest)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def cuda_probe(min_capability: tuple[int, int] | None = None) -> str | None:
    """``None`` when a CUDA/ROCm GPU is visible to torch (and meets ``min_capability``, e.g. (9, 0))."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible to torch"
    if min_capability is None or torch.version.hip:
        return None  # ROCm reports gfx arch as a pseudo compute capability; callers check arch by name
    have = torch.cuda.get_device_capability()
    if tuple(have) < tuple(min_capability):
        return (
            f"GPU compute capability {have[0]}.{have[1]} < required "
            f"{min_capability[0]}.{min_capability[1]} ({torch.cuda.get_device_name()})"
        )
    return None


def first_reason(*probes: Callable[[], str | None]) -> str | None:
    """Run ``probes`` in order; return the first reason, or ``None`` when all pass."""
    for probe in probes:
        reason = probe()
        if reason:
            return reason
    return None
