"""The rollouter server's last preload: per-process work every forked rollouter would otherwise repeat.

The rollouter server (:mod:`lumenrl_backends.rollouter_server`) imports this module after its other
preloads; importing it runs :func:`warm` once, in the server, so each child forked from it starts with:

* the native engine's modules imported (its Triton kernels declared, its custom ops registered);
* Triton's installation hash computed (``triton_key``: it hashes Triton's sources and ``libtriton`` at
  the first kernel compile or cache lookup of a process, a quarter of a second);
* transformers' checkpoint conversion table built (a thousand regular expressions, compiled at a
  process's first ``from_pretrained``) and the modeling modules of the model families LumenRL supports
  imported (their ``import`` is most of a small model's load);
* the process-wide plugin registry's entry points listed (one metadata scan per plugin kind; no plugin
  code is imported);
* every object so far moved to the collector's permanent generation (``gc.freeze``): a forked child
  shares the server's memory pages until it writes them, and a full collection (the engine runs one
  before its first CUDA graph capture) would write to every object it visits, copying those pages
  one fault at a time (the cost was ~0.3 s per collection on an H200 host). Frozen objects are not
  visited; what a child creates itself is.

Each step is best effort: a library version without the hook, or a step that fails for any reason (a
plugin registered twice, say), skips it, and :data:`WARMED` names the steps done. Nothing here touches
CUDA: the server's children must be able to initialize it.
"""

from __future__ import annotations

import gc
import importlib

__all__ = ["MODEL_FAMILIES", "STEPS", "WARMED", "warm"]

# transformers.models.<family>.modeling_<family>: the architectures LumenRL trains and serves
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "deepseek_v3", "glm4_moe")


def _engine_modules() -> None:
    import lumenrl_backends.engines.native  # noqa: F401 - kernels declared, custom ops registered


def _triton_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()


def _conversion_mapping() -> None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")


def _modeling_modules() -> None:
    imported = 0
    for family in MODEL_FAMILIES:
        try:
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            imported += 1
        except Exception:  # noqa: BLE001 - a family this transformers does not have
            pass
    if not imported:
        raise ImportError("no modeling module of the supported families")


def _plugin_entry_points() -> None:
    from lumenrl_core.plugins.kinds import KINDS
    from lumenrl_core.plugins.registry import get_registry

    registry = get_registry()
    for kind in KINDS:
        registry.names(kind)  # lists entry points; imports no plugin


STEPS = {"engine_modules": _engine_modules, "triton_key": _triton_key, "conversion_mapping": _conversion_mapping,
         "modeling_modules": _modeling_modules, "plugin_entry_points": _plugin_entry_points}


def warm() -> tuple[str, ...]:
    """Run the warm-up steps (module docstring); the names of those that ran. A step that fails is skipped:
    Python's forkserver survives only an ``ImportError`` in a preload, and a warm-up must never cost the
    server (the child then does that work itself, as it did before)."""
    done = []
    for name, step in STEPS.items():
        try:
            step()
            done.append(name)
        except Exception:  # noqa: BLE001 - best effort (docstring)
            pass
    gc.freeze()
    done.append("gc_freeze")
    return tuple(done)


WARMED = warm()
