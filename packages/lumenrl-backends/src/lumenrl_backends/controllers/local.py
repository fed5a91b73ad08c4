"""LocalController: dispatch over in-process workers (one process, or one per torchrun rank).

Under torchrun each process holds a group of its own rank-local worker(s); data parallelism
across processes happens inside the training backend (each rank takes its slice of the batch),
so ``dp_compute_proto`` over a 1-worker group passes the whole batch through. Groups of several
in-process workers (tests, CPU-side reward workers) are split as the dispatch mode says.
Workers run one after another, in rank order.
"""

from __future__ import annotations

from typing import Any

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.controllers.dispatch import plan_dispatch
from lumenrl_backends.controllers.worker_group import WorkerGroup

__all__ = ["LocalController"]


def _bound_method(worker: Any, method: str, group: WorkerGroup, rank: int):
    if group.role is not None:  # an in-process RoleHost
        worker = worker.roles[group.role]
    fn = getattr(worker, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(
            f"worker {rank} of group {group.name!r} ({type(worker).__name__}) has no method {method!r}"
        )
    return fn


class LocalController:
    """Runs group methods in this process under the single-controller dispatch modes."""

    capabilities = manifest.LOCAL.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.LOCAL.unavailable_reason()

    @classmethod
    def from_config(cls, cfg: Any = None) -> LocalController:
        return cls()

    def call(
        self, group: WorkerGroup, method: str, *args: Any, dispatch: str | None = None, **kwargs: Any
    ) -> Any:
        """Fan ``method`` out over ``group`` by ``dispatch`` (default: the method's declared mode)."""
        mode = dispatch or group.declared_dispatch(method)
        plan = plan_dispatch(mode, args, kwargs, group.world_size)
        outputs = [
            _bound_method(group[c.rank], method, group, c.rank)(*c.args, **c.kwargs) for c in plan.calls
        ]
        return plan.collect(outputs)
