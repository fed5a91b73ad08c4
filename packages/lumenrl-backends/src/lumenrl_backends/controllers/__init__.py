"""Controllers: WorkerGroups and the single-controller dispatch modes (local in-process, Ray)."""

from lumenrl_backends.controllers.dispatch import (
    DEFAULT_DISPATCH,
    DISPATCH_MODES,
    normalize_dispatch,
    plan_dispatch,
    reduce_metrics,
    register,
)
from lumenrl_backends.controllers.local import LocalController
from lumenrl_backends.controllers.worker_group import WorkerGroup

__all__ = [
    "DEFAULT_DISPATCH",
    "DISPATCH_MODES",
    "LocalController",
    "WorkerGroup",
    "normalize_dispatch",
    "plan_dispatch",
    "reduce_metrics",
    "register",
]
