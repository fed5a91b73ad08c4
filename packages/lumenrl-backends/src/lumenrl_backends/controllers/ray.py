"""RayController: the same dispatch modes over Ray actors (multi-node = a Ray cluster).

A group is spawned with :meth:`RayController.spawn`: one actor per rank, each pinned to a
bundle of a placement group (pass the same ``placement_group`` to several spawns to colocate
roles on the same resources). Every actor gets the torch.distributed environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) so the FSDP2
backend inside forms its process group exactly as under torchrun. ``call`` splits arguments
with :mod:`lumenrl_backends.controllers.dispatch`, issues ``method.remote`` on the ranks and
collects with ``ray.get``.

Limits of this release: ``MASTER_ADDR`` is the driver's node, so a group whose actors span
nodes needs the driver on a node reachable by all; colocated groups share bundles but not GPUs'
memory management (no offload between roles).
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Any

from lumenrl_backends.controllers.dispatch import plan_dispatch
from lumenrl_backends.controllers.worker_group import WorkerGroup

__all__ = ["RayController"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class RayController:
    """Runs group methods on Ray actors under the single-controller dispatch modes."""

    capabilities = frozenset({"dispatch_modes", "multi_node", "placement_groups"})

    @classmethod
    def probe(cls) -> str | None:
        if importlib.util.find_spec("ray") is None:
            return "ray is not installed (pip install 'lumenrl-backends[ray]')"
        return None

    def __init__(self, *, address: str = "", num_cpus_per_worker: float = 1.0, colocate: bool = True) -> None:
        import ray

        self.ray = ray
        self.num_cpus_per_worker = num_cpus_per_worker
        self.colocate = colocate
        if not ray.is_initialized():
            ray.init(address=address or None, ignore_reinit_error=True)

    @classmethod
    def from_config(cls, cfg: Any) -> RayController:
        rc = cfg.controller.ray
        return cls(address=rc.address, num_cpus_per_worker=rc.num_cpus_per_worker, colocate=rc.colocate)

    def placement_group(self, world_size: int, *, num_gpus_per_worker: float = 0.0):
        """A PACKed placement group with one bundle per rank (ready when returned)."""
        from ray.util.placement_group import placement_group

        bundle = {"CPU": self.num_cpus_per_worker}
        if num_gpus_per_worker:
            bundle["GPU"] = num_gpus_per_worker
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self.ray.get(pg.ready())
        return pg

    def spawn(
        self,
        worker_cls: type,
        world_size: int,
        *,
        args: tuple = (),
        kwargs: dict | None = None,
        name: str = "workers",
        num_gpus_per_worker: float = 0.0,
        placement_group: Any = None,
    ) -> WorkerGroup:
        """One actor of ``worker_cls(*args, **kwargs)`` per rank; returns their WorkerGroup."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group or self.placement_group(world_size, num_gpus_per_worker=num_gpus_per_worker)
        env = {"WORLD_SIZE": str(world_size), "MASTER_PORT": str(_free_port())}
        env["MASTER_ADDR"] = self.ray.util.get_node_ip_address()
        remote_cls = self.ray.remote(worker_cls)

        def local_rank(rank: int) -> str:  # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU(s)
            return "0" if num_gpus_per_worker else str(rank)

        actors = [
            remote_cls.options(
                num_cpus=self.num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": {**env, "RANK": str(rank), "LOCAL_RANK": local_rank(rank)}},
            ).remote(*args, **(kwargs or {}))
            for rank in range(world_size)
        ]
        return WorkerGroup(actors, name=name, controller=self, worker_cls=worker_cls)

    def call(
        self, group: WorkerGroup, method: str, *args: Any, dispatch: str | None = None, **kwargs: Any
    ) -> Any:
        """Fan ``method`` out over the group's actors by ``dispatch`` and wait for the results."""
        plan = plan_dispatch(dispatch or group.declared_dispatch(method), args, kwargs, group.world_size)
        refs = [getattr(group[c.rank], method).remote(*c.args, **c.kwargs) for c in plan.calls]
        return plan.collect(self.ray.get(refs))
