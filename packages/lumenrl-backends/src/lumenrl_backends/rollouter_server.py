"""Where a rollouter process comes from: a ``multiprocessing`` forkserver that has imported its modules.

A spawned rollouter starts a fresh interpreter and imports torch, transformers and LumenRL before it
can load a model: seconds to tens of seconds, which a short async run pays at its first step. A
forkserver pays those imports once, in a process of its own, and then forks each rollouter from that
state: the child starts with its modules imported. :func:`prestart` starts that server early (``lumenrl
train`` calls it as soon as the config says the run has a rollouter process, before its own imports
and model loads), so the server's imports overlap the trainer's instead of following them.

The server never touches CUDA (importing torch or transformers does not initialize it), so its
children may. It is Python's own forkserver, one per process: a caller that started it earlier with
other modules (a test session's rank forkserver) keeps its own list, and the rollouter imports what
is missing itself. A child gets the caller's environment and ``sys.path`` at its creation, as a
spawned one would (:func:`adopt_caller_state`), not the server's from its start. Where fork is not
available (Windows), rollouters are spawned. This module imports no torch.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

__all__ = ["PRELOAD", "adopt_caller_state", "caller_state", "context", "prestart", "uses_rollouter_process"]

# What a rollouter imports before it builds (torch-free to name; imported in the server only)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "lumenrl_core.assembly",
    "lumenrl_backends.models",
    "lumenrl_backends.trainers.rollouter_process",
    "lumenrl_backends.trainers.async_rl",
    "lumenrl_backends.trainers.data",
    "lumenrl_backends.rollouter_warmup",  # last: per-process warm-up, then gc.freeze() (see that module)
)


def start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def context() -> Any:
    """The ``multiprocessing`` context rollouter processes are made with (the server starts at its first use)."""
    import torch.multiprocessing as mp  # its reductions share tensors across the channel

    method = start_method()
    if method == "forkserver":
        _ask_for_preload()
    return mp.get_context(method)


def _ask_for_preload() -> None:
    if not _server_running():  # a running server keeps the list it started with
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))


def uses_rollouter_process(cfg: Any) -> bool:
    """Whether the run's rollouter is a local process (async trainer, local controller, a cross-process
    weight sync): read from the config alone, before any plugin loads."""
    return (cfg.trainer.name == "async_rl" and cfg.controller.name != "ray"
            and cfg.weight_sync.method != "inprocess")


def prestart() -> bool:
    """Start the rollouter server now, in the background (its imports run while the caller goes on);
    True when a forkserver is running after the call. Idempotent."""
    if start_method() != "forkserver":
        return False
    _ask_for_preload()  # not context(): that imports torch here, and the point is to start before that
    from multiprocessing import forkserver

    forkserver.ensure_running()  # starts the server process and returns; it imports PRELOAD, then serves
    return _server_running()


def _server_running() -> bool:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None  # noqa: SLF001 (no public query)


def caller_state() -> dict[str, Any]:
    """What a spawned child would inherit from its caller at creation: environment and ``sys.path``."""
    return {"env": dict(os.environ), "sys_path": list(sys.path)}


def adopt_caller_state(state: dict[str, Any]) -> None:
    """In the child, first thing: the caller's environment and ``sys.path`` (:func:`caller_state`), in
    place of the server's from its start; torch's thread count follows the caller's ``OMP_NUM_THREADS``."""
    os.environ.clear()
    os.environ.update(state["env"])
    sys.path[:] = state["sys_path"]
    threads = state["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
