"""The rollouter as a Ray actor (``controller.name: ray`` with ``trainer.name: async_rl``).

Placement: the training roles run in ``RoleHost`` actors as for the synchronous trainer
(:func:`~lumenrl_backends.trainers.placement.ray_roles`: actor / ref / critic, plus the engine that
serves evaluation, colocated or in its own pool per ``controller.ray.colocate``); the rollouter is
one more ``RoleHost`` on a placement group of its own (one bundle of ``controller.ray.num_cpus_per_worker``
CPUs and ``num_gpus_per_worker`` GPUs: its own device) holding the role ``rollouter``, a
:class:`RollouterWorker` built inside the actor by
:func:`~lumenrl_backends.trainers.rollouter_process.build_rollouter`. The driver runs only the
trainer loop (queue, scoring, phase calls).

Samples: the worker's sink puts each finished group into a :class:`lumenrl_async.Outbox`
(``produced`` counted first); the driver's pump thread calls ``poll(ledger)`` and gets the queued
messages, ``produced`` and the rollouter's stats in one reply, so in transit is never negative; the
queue's ledger (taken, stale drops) tells the rollouter which samples are outstanding and which the
trainer dropped as stale (its staleness budget).
A dead actor (``WorkerDiedError``) or a failed rollout thread (its error string) ends the run the
way a dead rollouter process does: what was counted but never delivered is dropped as
``rollouter_crash``.

Weights: :class:`~lumenrl_backends.trainers.async_weights.RayPublisher` (the writer in training
rank 0's host): ``collective`` broadcasts to this actor over the rank-0 node's address,
``filesystem`` needs a directory both see (``weight_sync.snapshot_dir`` on a shared filesystem).
"""

from __future__ import annotations

import threading
from typing import Any

from lumenrl_async import Outbox, SampleQueue, deliver
from lumenrl_core.data_proto import DataProto

__all__ = ["RayRollouter", "RollouterWorker"]


class RollouterWorker:
    """The ``rollouter`` role inside its ``RoleHost`` actor."""

    role = "rollouter"

    def __init__(self, cfg: Any, start: dict[str, Any]) -> None:
        from lumenrl_backends.trainers.rollouter_process import build_rollouter

        self.outbox, self.stop_event = Outbox(), threading.Event()
        self.rollouter, self.engine, self.reader = build_rollouter(
            cfg, start, sink=self.outbox.send, ledger=self.outbox.ledger, stop=self.stop_event)
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    @classmethod
    def from_config(cls, cfg: Any, *, start: dict[str, Any]) -> RollouterWorker:
        return cls(cfg, start)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollouter")
        self._thread.start()

    def _run(self) -> None:
        try:
            self.rollouter.run()
        except BaseException as exc:  # reported by the next poll
            self.error = f"{type(exc).__name__}: {exc}"

    def _stats(self) -> dict[str, float]:
        return {**self.rollouter.stats, "round": self.rollouter.round}

    def poll(self, ledger: tuple[int, int], wait_s: float = 0.05) -> dict[str, Any]:
        """Finished groups since the last poll, ``produced`` (read with them), stats, health."""
        messages, produced = self.outbox.poll(ledger, wait_s)
        running = self._thread is not None and self._thread.is_alive()
        return {"messages": messages, "produced": produced, "stats": self._stats(), "running": running,
                "error": self.error}

    def stop(self, timeout: float = 60.0) -> dict[str, float]:
        self.stop_event.set()
        self.engine.interrupt()
        if self._thread is not None:
            self._thread.join(timeout)
        if hasattr(self.reader, "close"):
            self.reader.close()
        return self._stats()

    def process(self) -> dict[str, Any]:
        import os

        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


class RayRollouter:
    """The trainer's side of the rollouter actor (the interface :class:`ProcessRollouter` shares)."""

    def __init__(self, controller: Any, cfg: Any, start: dict[str, Any]) -> None:
        self.controller = controller
        self.pg = controller.placement_group(1)
        self.hosts = controller.hosts(1, name="rollouter", cpu_threads=cfg.trainer.cpu_threads,
                                      placement_group=self.pg)
        controller.call(self.hosts, "add_role", "rollouter", RollouterWorker, cfg, dispatch="one_to_all", start=start)
        self.view = controller.view(self.hosts, "rollouter", RollouterWorker)
        self.where = self._call("process")
        self._stats: dict[str, float] = {}
        self._produced = 0
        self._running = True
        self._error: str | None = None
        self._done = threading.Event()
        self._pump: threading.Thread | None = None

    def _call(self, method: str, *args: Any) -> Any:
        return self.controller.call(self.view, method, *args, dispatch="rank_zero")

    def begin(self, sample_queue: SampleQueue) -> None:
        self._call("start")
        self._pump = threading.Thread(target=self._pump_loop, args=(sample_queue,), daemon=True, name="async-pump")
        self._pump.start()

    def _poll(self, sample_queue: SampleQueue, *, closing: bool = False, wait_s: float = 0.05,
              stop: threading.Event | None = None) -> bool:
        """One poll into ``sample_queue``; False once the actor is gone or its rollout thread ended. ``stop``: the
        pump's event, which ends a wait for room in a full queue (lumenrl_async.channel.deliver)."""
        from lumenrl_backends.controllers.ray import WorkerDiedError

        try:
            reply = self._call("poll", sample_queue.ledger(), wait_s)
        except WorkerDiedError as exc:
            self._running, self._error = False, str(exc)
            return False
        self._produced, self._stats = int(reply["produced"]), reply["stats"]
        for msg in reply["messages"]:
            deliver(sample_queue, msg, self._produced, DataProto.from_bytes, closing=closing, stop=stop)
        self._running, self._error = reply["running"], reply["error"]
        return bool(reply["messages"]) or self._running

    def _pump_loop(self, sample_queue: SampleQueue) -> None:
        while not self._done.is_set() and self._poll(sample_queue, stop=self._done):
            pass

    def _stop_pump(self) -> None:
        self._done.set()
        if self._pump is not None:
            self._pump.join()

    def alive(self) -> bool:
        return self._running

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def placement(self) -> dict[str, Any]:
        return {"rollouter": "ray_actor", "rollouter_pid": self.where["pid"], "rollouter_node": self.where["node_id"]}

    def exit_info(self) -> str:
        return f"ray actor: {self._error or 'rollout thread ended'}"

    def _settle(self, sample_queue: SampleQueue, reason: str) -> None:
        sample_queue.note_produced(self._produced - sample_queue.produced)
        sample_queue.drop_in_transit(reason)

    def settle_crash(self, sample_queue: SampleQueue) -> None:
        self._stop_pump()
        self._poll(sample_queue, closing=True, wait_s=0.0)  # a failed thread's actor still answers
        self._settle(sample_queue, "rollouter_crash")

    def stop(self, sample_queue: SampleQueue, timeout: float = 60.0) -> None:
        """Stop the rollout thread, receive what it finished (dropped: ``shutdown``), end the actor."""
        from lumenrl_backends.controllers.ray import WorkerDiedError

        self._stop_pump()
        try:
            self._stats = self._call("stop", timeout)
            self._poll(sample_queue, closing=True, wait_s=0.0)
        except WorkerDiedError as exc:
            self._error = str(exc)
        self._settle(sample_queue, "shutdown")
        self.controller.release(self.hosts, self.pg)
