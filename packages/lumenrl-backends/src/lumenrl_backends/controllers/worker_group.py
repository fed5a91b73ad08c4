"""WorkerGroup: the ranks of one role (actor, ref, critic, rollout, reward, ...).

For the local controller a rank is a plain in-process object; for the Ray controller it is an
actor handle, or a role host (``role=...``: one process holding several roles). ``group.call(method, *args, dispatch=mode)`` is shorthand for
``controller.call(group, method, ...)`` with the group's controller (local by default).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from lumenrl_backends.controllers.dispatch import declared_dispatch

__all__ = ["WorkerGroup"]


class WorkerGroup:
    """An ordered list of rank-local workers (rank r = ``workers[r]``)."""

    def __init__(
        self,
        workers: Sequence[Any],
        *,
        name: str = "workers",
        controller: Any = None,
        worker_cls: type | None = None,
        role: str | None = None,
    ) -> None:
        if not workers:
            raise ValueError(f"WorkerGroup {name!r} needs at least one worker, got an empty list")
        self.workers = list(workers)
        self.name = name
        self.controller = controller
        self.worker_cls = worker_cls or type(self.workers[0])  # remote handles: pass the worker class
        self.role = role  # set: the workers are role hosts, a call runs ``worker.run(role, method, ...)``

    def declared_dispatch(self, method: str) -> str:
        """The dispatch mode ``method`` declared with ``@register`` on the worker class (else the default)."""
        return declared_dispatch(self.worker_cls, method)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.workers)

    def __getitem__(self, rank: int) -> Any:
        return self.workers[rank]

    def __repr__(self) -> str:
        kinds = sorted({type(w).__name__ for w in self.workers})
        return f"WorkerGroup(name={self.name!r}, world_size={self.world_size}, workers={kinds})"

    def call(self, method: str, *args: Any, dispatch: str | None = None, **kwargs: Any) -> Any:
        if self.controller is None:
            from lumenrl_backends.controllers.local import LocalController

            self.controller = LocalController()
        return self.controller.call(self, method, *args, dispatch=dispatch, **kwargs)
