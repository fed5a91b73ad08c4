"""``async_rl``: publishing the trainer's weights to the rollouter, wherever the training roles run.

A publisher owns the writer of the run's weight sync (``weight_sync.method``, a ``lumenrl.weight_syncs``
plugin) and hands it the trainer's weights as a lazy mapping (:class:`~lumenrl_backends.sync.filesystem.LazyWeights`:
each tensor gathered from its FSDP2 shards and cast to the engine dtype only when the writer reads
it, so no full copy of the model is made on the device):

* :class:`LocalPublisher`: training roles in this process (local controller);
* :class:`RayPublisher`: training roles in Ray ``RoleHost`` actors; the writer lives in training
  rank 0's host, every training rank walks the weights at a publish (the gathers are collective).

``reader_handle()`` is what the rollouter's process needs to open the reading side
(``weight_sync_cls.reader(handle, device=...)``): a snapshot directory, CUDA IPC handles, or a
broadcast group's address (the training rank-0 node's address under Ray).
"""

from __future__ import annotations

from typing import Any

import torch

from lumenrl_backends.sync.filesystem import LazyWeights

__all__ = ["LocalPublisher", "RayPublisher", "publish_dtype"]


def publish_dtype(device: torch.device) -> torch.dtype | None:
    """What the engine holds: bf16 on an accelerator, the trainer's own dtype on CPU."""
    return None if device.type == "cpu" else torch.bfloat16


class LocalPublisher:
    """The writer and the training backend in one process."""

    def __init__(self, writer: Any, backend: Any, device: torch.device) -> None:
        self.writer, self.backend, self.dtype = writer, backend, publish_dtype(device)

    def reader_handle(self, host: str = "127.0.0.1") -> Any:
        """``host``: this process's address as the rollouter sees it (a broadcast group's only)."""
        if "collective" in self.writer.capabilities:
            return self.writer.reader_handle(host)
        return self.writer.reader_handle()

    def wait_for_readers(self, alive: Any) -> None:
        """A broadcast group: block until the rollouter's reader registered, failing as soon as
        ``alive()`` is false (other syncs need no reader to publish)."""
        if "collective" in self.writer.capabilities:
            self.writer.wait_for_readers(alive)

    def publish(self, version: int) -> dict[str, float]:
        return self.writer.publish(LazyWeights(self.backend, self.dtype), int(version)) or {}

    def close(self, *, notify: bool) -> None:
        """Release the writer (``notify``: tell live readers; a broadcast group's only)."""
        close = getattr(self.writer, "close", None)
        if close is not None:
            close(notify=notify)

    @staticmethod
    def walk(backend: Any, device: torch.device) -> None:
        """A training rank > 0 during a publish: take part in every gather, in the writer's order."""
        weights = LazyWeights(backend, publish_dtype(device))
        for name in weights:
            weights[name]


class RayPublisher:
    """The writer in training rank 0's ``RoleHost`` (``open_weight_sync`` / ``publish_weights``)."""

    def __init__(self, actor_view: Any, sync_cls: type, cfg: Any) -> None:
        from lumenrl_backends.controllers.worker_group import WorkerGroup
        from lumenrl_backends.workers.host import RoleHost

        self.controller = actor_view.controller
        self.hosts = WorkerGroup(actor_view.workers, name="train", controller=self.controller, worker_cls=RoleHost)
        self.sync_cls, self.cfg = sync_cls, cfg

    def reader_handle(self) -> Any:
        return self.controller.call(self.hosts, "open_weight_sync", self.sync_cls, self.cfg, dispatch="rank_zero")

    def publish(self, version: int) -> dict[str, float]:
        return self.controller.call(self.hosts, "publish_weights", int(version), dispatch="one_to_all")[0]

    def close(self, *, notify: bool) -> None:
        self.controller.call(self.hosts, "close_weight_sync", notify, dispatch="rank_zero")
