"""RayController: the same dispatch modes over Ray actors (multi-node = a Ray cluster).

Two ways to make a group:

* :meth:`RayController.spawn` - one actor of any class per rank (tests, custom workers);
* :meth:`RayController.hosts` + :meth:`RayController.view` - the trainer's path: one
  :class:`~lumenrl_backends.workers.host.RoleHost` actor per rank on a placement group, roles
  built inside it (``add_role``) and each role seen as its own WorkerGroup (``view``) whose calls
  go through ``host.run(role, method, ...)`` with the role class's declared dispatch modes.

Every actor gets the torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) so the FSDP2 backend inside forms its process group exactly as
under torchrun (gloo on CPU, NCCL on GPU). ``MASTER_ADDR`` is the node of rank 0's actor.
``call`` splits arguments with :mod:`lumenrl_backends.controllers.dispatch`, issues
``method.remote`` on the ranks and collects with ``ray.get``; ``submit``/``wait`` split that in
two so calls on different groups overlap (the weight sync between pools needs it). A rank whose
actor died raises :class:`WorkerDiedError` naming the group (role) and rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.controllers.dispatch import DispatchPlan, plan_dispatch
from lumenrl_backends.controllers.worker_group import WorkerGroup

__all__ = ["RayController", "WorkerDiedError", "Pending"]

_PASSED_ENV = ("LUMENRL_CACHE", "HF_HOME", "TRITON_INTERPRET")


class WorkerDiedError(RuntimeError):
    """A worker of a group died during a call (the message names role, rank and method)."""

    def __init__(self, role: str, rank: int, method: str, cause: BaseException) -> None:
        self.role, self.rank, self.method = role, rank, method
        super().__init__(
            f"worker {role!r} rank {rank} died during {method!r}: {type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''} (the last saved checkpoint is intact; "
            "restart the run with checkpointing.resume=true to continue from it)"
        )


@dataclass(slots=True)
class Pending:
    """A submitted call: per-rank object refs and how to combine them."""

    group: WorkerGroup
    method: str
    plan: DispatchPlan
    refs: list[Any]


class RayController:
    """Runs group methods on Ray actors under the single-controller dispatch modes."""

    capabilities = manifest.RAY.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.RAY.unavailable_reason()

    def __init__(self, *, address: str = "", num_cpus_per_worker: float = 1.0, num_gpus_per_worker: float = 0.0,
                 colocate: bool = True, num_workers: int = 1, rollout_workers: int = 0,
                 release_rollout_memory: bool = True, placement_strategy: str = "PACK") -> None:
        import ray

        self.ray = ray
        self.num_cpus_per_worker = num_cpus_per_worker
        self.num_gpus_per_worker = num_gpus_per_worker
        self.colocate = colocate
        self.num_workers = num_workers
        self.rollout_workers = rollout_workers or num_workers
        self.release_rollout_memory = release_rollout_memory
        self.placement_strategy = placement_strategy
        self._placement_groups: list[Any] = []
        if not ray.is_initialized():
            if not (address or os.environ.get("RAY_ADDRESS")):
                # a Ray this process may start itself: its workers are the run's roles (the training and the
                # rollout), not background work, so they keep the driver's priority instead of Ray's default
                # niceness 15, which on a machine busy with other work starved them (a 9 s job took minutes);
                # RAY_worker_niceness set by the user wins
                os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address=address or None, ignore_reinit_error=True)

    @classmethod
    def from_config(cls, cfg: Any) -> RayController:
        rc = cfg.controller.ray
        return cls(
            address=rc.address, num_cpus_per_worker=rc.num_cpus_per_worker,
            num_gpus_per_worker=rc.num_gpus_per_worker, colocate=rc.colocate, num_workers=rc.num_workers,
            rollout_workers=rc.rollout_workers, release_rollout_memory=rc.release_rollout_memory,
            placement_strategy=rc.placement_strategy,
        )

    # ------------------------------------------------------------------ placement

    def placement_group(self, world_size: int, *, num_gpus_per_worker: float | None = None,
                        strategy: str | None = None):
        """A placement group with one bundle per rank (ready when returned)."""
        from ray.util.placement_group import placement_group

        gpus = self.num_gpus_per_worker if num_gpus_per_worker is None else num_gpus_per_worker
        bundle = {"CPU": self.num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy or self.placement_strategy)
        self.ray.get(pg.ready(), timeout=300)
        self._placement_groups.append(pg)
        return pg

    def _options(self, pg: Any, rank: int, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.num_cpus_per_worker, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)}

    def _rank_env(self, world_size: int, gpus: float, addr: str, port: int) -> list[dict[str, str]]:
        # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU(s): local rank 0 inside the actor
        import os

        shared = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}  # e.g. the driver's model cache
        return [{**shared, "WORLD_SIZE": str(world_size), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                 "RANK": str(r), "LOCAL_RANK": "0" if gpus else str(r), "OMP_NUM_THREADS": "1"}
                for r in range(world_size)]

    def _master(self, pg: Any) -> tuple[str, int]:
        """An address and free port on the node of bundle 0 (where rank 0 will run)."""
        probe = self.ray.remote(num_cpus=0)(_node_address_and_port)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        return self.ray.get(probe.options(scheduling_strategy=strategy).remote())

    def spawn(self, worker_cls: type, world_size: int, *, args: tuple = (), kwargs: dict | None = None,
              name: str = "workers", num_gpus_per_worker: float = 0.0, placement_group: Any = None) -> WorkerGroup:
        """One actor of ``worker_cls(*args, **kwargs)`` per rank; returns their WorkerGroup."""
        pg = placement_group or self.placement_group(world_size, num_gpus_per_worker=num_gpus_per_worker)
        addr, port = self._master(pg)
        remote_cls = self.ray.remote(worker_cls)
        actors = [
            remote_cls.options(**self._options(pg, r, num_gpus_per_worker), runtime_env={"env_vars": env})
            .remote(*args, **(kwargs or {}))
            for r, env in enumerate(self._rank_env(world_size, num_gpus_per_worker, addr, port))
        ]
        return WorkerGroup(actors, name=name, controller=self, worker_cls=worker_cls)

    def hosts(self, world_size: int, *, name: str, cpu_threads: int = 0, placement_group: Any = None) -> WorkerGroup:
        """One :class:`RoleHost` actor per rank on its own (or the given) placement group."""
        from lumenrl_backends.workers.host import RoleHost

        pg = placement_group or self.placement_group(world_size)
        addr, port = self._master(pg)
        gpus = self.num_gpus_per_worker
        remote_cls = self.ray.remote(RoleHost)
        actors = [
            remote_cls.options(**self._options(pg, r, gpus)).remote(env, cpu_threads=cpu_threads)
            for r, env in enumerate(self._rank_env(world_size, gpus, addr, port))
        ]
        return WorkerGroup(actors, name=name, controller=self, worker_cls=RoleHost)

    def view(self, hosts: WorkerGroup, role: str, worker_cls: type) -> WorkerGroup:
        """The ``role`` hosted by ``hosts`` as a WorkerGroup with ``worker_cls``'s dispatch modes."""
        return WorkerGroup(hosts.workers, name=role, controller=self, worker_cls=worker_cls, role=role)

    # ------------------------------------------------------------------ calls

    def submit(self, group: WorkerGroup, method: str, *args: Any, dispatch: str | None = None,
               **kwargs: Any) -> Pending:
        plan = plan_dispatch(dispatch or group.declared_dispatch(method), args, kwargs, group.world_size)
        refs = []
        for c in plan.calls:
            actor = group[c.rank]
            if group.role is not None:
                refs.append(actor.run.remote(group.role, method, *c.args, **c.kwargs))
            else:
                refs.append(getattr(actor, method).remote(*c.args, **c.kwargs))
        return Pending(group, method, plan, refs)

    def wait(self, pending: Pending) -> Any:
        from ray.exceptions import RayActorError

        rank_of = {ref: call.rank for call, ref in zip(pending.plan.calls, pending.refs)}
        rest = list(pending.refs)
        while rest:  # as each finishes: a dead rank is reported even while the others wait on it
            done, rest = self.ray.wait(rest, num_returns=1)
            try:
                self.ray.get(done[0])
            except RayActorError as err:
                raise WorkerDiedError(pending.group.name, rank_of[done[0]], pending.method, err) from err
        return pending.plan.collect(self.ray.get(pending.refs))

    def call(self, group: WorkerGroup, method: str, *args: Any, dispatch: str | None = None, **kwargs: Any) -> Any:
        """Fan ``method`` out over the group's actors by ``dispatch`` and wait for the results."""
        return self.wait(self.submit(group, method, *args, dispatch=dispatch, **kwargs))

    def release(self, group: WorkerGroup, placement_group: Any) -> None:
        """Kill one group's actors and remove the placement group made for it (the others stay)."""
        from ray.util.placement_group import remove_placement_group

        for actor in group.workers:
            self.ray.kill(actor)
        if placement_group in self._placement_groups:
            self._placement_groups.remove(placement_group)
            remove_placement_group(placement_group)

    def shutdown(self, *groups: WorkerGroup) -> None:
        """Kill the groups' actors (their processes exit) and release this controller's placement groups."""
        from ray.util.placement_group import remove_placement_group

        for group in groups:
            for actor in group.workers:
                self.ray.kill(actor)
        while self._placement_groups:
            remove_placement_group(self._placement_groups.pop())


def _node_address_and_port() -> tuple[str, int]:
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
    return ray.util.get_node_ip_address(), port
