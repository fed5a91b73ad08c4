"""RoleHost: one worker process (a Ray actor) holding one or more roles of a run.

Colocated placement puts ``actor`` (+ ``ref``, ``critic``) and ``rollout`` in the same host, one
host per rank: the roles share the process, its device and its ``torch.distributed`` group, the
engine's weights are synced in process and its KV cache is freed while training runs.
Disaggregated placement has a training pool of hosts (``actor``/``ref``/``critic``) and a rollout
pool (``rollout`` only); weights travel over a :class:`~lumenrl_backends.sync.channel.WeightChannel`.

A role is built inside the host from the run config (``add_role``), so models load where they
run. The controller reaches a role's method through ``run(role, method, ...)`` (a WorkerGroup
with ``role=...`` does that), keeping the role classes' ``@register`` dispatch modes.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["RoleHost"]


class RoleHost:
    """A process that hosts roles; ``env`` (RANK, WORLD_SIZE, MASTER_*...) is set before any build."""

    def __init__(self, env: dict[str, str] | None = None, *, cpu_threads: int = 0) -> None:
        os.environ.update(env or {})
        self.roles: dict[str, Any] = {}
        self.channel: Any = None
        self.publisher: Any = None  # async_rl, training rank 0: the weight sync's writer
        self.cpu_threads = cpu_threads
        if cpu_threads > 0:
            import torch

            torch.set_num_threads(cpu_threads)

    def add_role(self, role: str, worker_cls: type, cfg: Any, **kwargs: Any) -> str:
        """Build ``worker_cls.from_config(cfg, **kwargs)`` here as ``role``; returns its class name."""
        from lumenrl_backends.trainers.build import seed_everything

        seed_everything(cfg.seed)  # the same initial weights as an in-process build
        self.roles[role] = worker_cls.from_config(cfg, **kwargs)
        return type(self.roles[role]).__name__

    def run(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        worker = self.roles.get(role)
        if worker is None:
            raise KeyError(f"this host has no role {role!r}; it holds {sorted(self.roles)}")
        return getattr(worker, method)(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")), "roles": sorted(self.roles),
                "node_id": ray.get_runtime_context().get_node_id()}

    # ------------------------------------------------------------------ weight sync

    def sync_local(self, version: int, bucket_size_mb: int) -> dict[str, float]:
        """Colocated: this process's actor weights into this process's engine."""
        from lumenrl_backends.trainers.sync import sync_weights

        return sync_weights(self.roles["actor"].backend, self.roles["rollout"].engine, version,
                            bucket_size_mb=bucket_size_mb)

    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port (the weight channel's store runs here)."""
        from lumenrl_backends.controllers.ray import _node_address_and_port

        return _node_address_and_port()

    def open_channel(self, host: str, port: int, member: int, size: int) -> None:
        """Join the weight channel as ``member`` (0: training rank 0; 1..R: rollout replicas)."""
        from lumenrl_backends.sync.channel import WeightChannel

        device = self._device()
        self.channel = WeightChannel(host=host, port=port, rank=member, size=size, device=device)

    def send_weights(self, version: int, bucket_size_mb: int) -> dict[str, float]:
        """Disaggregated, every training rank: rank 0 sends on the channel, the others join gathers."""
        from lumenrl_backends.sync.channel import WeightChannel

        backend, bucket = self.roles["actor"].backend, int(bucket_size_mb) << 20
        if self.channel is None:
            WeightChannel.drain(backend, bucket_bytes=bucket)
            return {}
        stats = self.channel.send(backend, bucket_bytes=bucket)
        return {**stats, "weight_sync/version": float(version)}

    def receive_weights(self, version: int) -> int:
        return self.channel.receive(self.roles["rollout"].engine, version)

    # ------------------------------------------------------------------ async_rl weight publishing

    def open_weight_sync(self, sync_cls: type, cfg: Any) -> Any:
        """Training rank 0: the writer of ``weight_sync.method``; returns its reader handle."""
        import ray

        from lumenrl_backends.trainers.async_weights import LocalPublisher

        self.publisher = LocalPublisher(sync_cls.from_config(cfg), self.roles["actor"].backend, self._device())
        return self.publisher.reader_handle(host=ray.util.get_node_ip_address())

    def publish_weights(self, version: int) -> dict[str, float]:
        """Every training rank: rank 0 publishes, the others join its gathers."""
        from lumenrl_backends.trainers.async_weights import LocalPublisher

        if self.publisher is None:
            LocalPublisher.walk(self.roles["actor"].backend, self._device())
            return {}
        return self.publisher.publish(version)

    def close_weight_sync(self, notify: bool) -> None:
        if self.publisher is not None:
            self.publisher.close(notify=notify)
            self.publisher = None

    def _device(self):
        import torch

        from lumenrl_backends.training import distributed as dist_utils

        if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
            return dist_utils.resolve_device("auto")
        return torch.device("cpu")
