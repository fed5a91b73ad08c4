"""Where a run's roles live: in this process (local controller) or in Ray actors (ray controller).

``local``: actor/ref/critic are in-process workers (one per torchrun rank) and the engine is this
process's own; under torchrun with W > 1 ranks the rollout is data-parallel
(:class:`~lumenrl_backends.workers.rollout.RankShardedRollout`: each rank generates its shard,
shards are all-gathered). Weight sync: in process.

``ray`` (``controller.name: ray`` or ``controller.ray.enabled: true``), ``controller.ray.num_workers``
= W training ranks, one :class:`~lumenrl_backends.workers.host.RoleHost` actor each, with
``torch.distributed`` initialized among them:

* colocated (``controller.ray.colocate: true``): each host also holds a rollout engine; rollout is
  data-parallel over the W hosts; weights sync in process on every rank; the engines' KV cache is
  freed while training runs (``controller.ray.release_rollout_memory``);
* disaggregated (``colocate: false``): ``controller.ray.rollout_workers`` = R rollout hosts in a
  pool of their own; rollout is data-parallel over the R replicas; weights go from training rank 0
  to the replicas over a weight channel (gloo on CPU, NCCL on GPU) while all training ranks gather.

The driver (this process) runs the trainer loop and holds only the tokenizer, data and scorer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lumenrl_backends.controllers.worker_group import WorkerGroup
from lumenrl_backends.models import is_builtin, load_model_and_tokenizer, resolve_model_path
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.workers import ActorWorker, CriticWorker, RefWorker
from lumenrl_backends.workers.rollout import GroupRollout, RankShardedRollout, RolloutWorker

__all__ = ["Roles", "local_roles", "ray_roles", "load_tokenizer", "rollout_elsewhere"]


@dataclass(kw_only=True)
class Roles:
    actor: WorkerGroup
    ref: WorkerGroup | None
    critic: WorkerGroup | None
    engine: Any  # .generate(batch, sampling): an engine or a data-parallel rollout client
    tokenizer: Any
    sync: Callable[[int], dict[str, float]]  # push the actor's weights to the rollout, as a version
    release_rollout: Callable[[], dict[str, float]] = field(default=lambda: {})
    close: Callable[[], None] = field(default=lambda: None)
    placement: dict[str, Any] = field(default_factory=dict)


def rollout_elsewhere(cfg: Any) -> bool:
    """``async_rl`` with its rollouter in a process of its own and no evaluation: this process needs no
    rollout engine (building one would hold a second copy of the weights and a KV cache on the GPU the
    rollouter process shares)."""
    return (cfg.trainer.name == "async_rl" and cfg.weight_sync.method != "inprocess"
            and cfg.controller.name != "ray" and not cfg.eval.enabled)


def _no_engine_sync(version: int) -> dict[str, float]:
    raise RuntimeError(f"weight sync to version {version}: this process has no rollout engine (async_rl's "
                       "rollouter runs in its own process and reads the run's weight sync)")


def _needs_reference(cfg: Any) -> bool:
    return bool(cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def _lora(cfg: Any) -> bool:
    """LoRA policy: the reference is the actor's base (``ActorWorker.compute_ref_log_prob``)."""
    return cfg.policy.lora.rank > 0


def _critic_path(cfg: Any, model_path: str) -> str:
    return resolve_model_path(cfg.critic.model_name) if cfg.critic.model_name else model_path


def load_tokenizer(cfg: Any, model_path: str) -> Any:
    from transformers import AutoTokenizer

    tok_path = resolve_model_path(cfg.policy.tokenizer_name) if cfg.policy.tokenizer_name else model_path
    local = is_builtin(cfg.policy.tokenizer_name or cfg.policy.model_name) or Path(tok_path).is_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=local,
                                              trust_remote_code=cfg.policy.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ------------------------------------------------------------------ local


def local_roles(plan: Any, model_path: str) -> Roles:
    """In-process workers; data-parallel rollout over torchrun ranks when there are several."""
    from lumenrl_backends.trainers.sync import sync_weights

    cfg, cls = plan.config, plan.training_backend_cls
    controller = plan.controller_cls.from_config(cfg)
    if cfg.cluster.num_nodes > 1 and dist_utils.world_size() == 1:
        raise RuntimeError(f"cluster.num_nodes={cfg.cluster.num_nodes} with one process: launch with torchrun "
                           "--nnodes (controller.name=local) or use controller.name=ray (scripts/launch_slurm.sh)")

    def group(worker_cls: type, path: str) -> WorkerGroup:
        worker = worker_cls.from_config(cfg, model_path=path, backend_cls=cls)
        return WorkerGroup([worker], name=worker_cls.role, controller=controller)

    actor = group(ActorWorker, model_path)
    ref = None
    if _needs_reference(cfg):  # LoRA: the actor's own base (adapters disabled) is the reference
        ref = actor if _lora(cfg) else group(RefWorker, model_path)
    critic = group(CriticWorker, _critic_path(cfg, model_path)) if cfg.critic.enabled else None
    if rollout_elsewhere(cfg):
        return Roles(actor=actor, ref=ref, critic=critic, engine=None, tokenizer=load_tokenizer(cfg, model_path),
                     sync=_no_engine_sync, placement={"controller": "local", "rollout_replicas": 0})
    model, tokenizer = load_model_and_tokenizer(
        model_path, dtype=cfg.policy.dtype, device=dist_utils.resolve_device(cfg.cluster.device),
        tokenizer_name=cfg.policy.tokenizer_name, trust_remote_code=cfg.policy.trust_remote_code,
    )
    engine = plan.rollout_engine_cls.from_config(cfg, model=model, tokenizer=tokenizer)
    client = engine
    if dist_utils.world_size() > 1:
        client = RankShardedRollout(engine, pad_token_id=tokenizer.pad_token_id or 0,
                                    rank=dist_utils.rank(), world=dist_utils.world_size())

    def sync(version: int) -> dict[str, float]:
        return sync_weights(actor[0].backend, engine, version, bucket_size_mb=cfg.weight_sync.bucket_size_mb)

    return Roles(actor=actor, ref=ref, critic=critic, engine=client, tokenizer=tokenizer, sync=sync,
                 placement={"controller": "local", "rollout_replicas": dist_utils.world_size()})


# ------------------------------------------------------------------ ray


def _add_role(controller: Any, hosts: WorkerGroup, role: str, worker_cls: type, cfg: Any, **kwargs: Any) -> None:
    """Build ``role`` on every host at once (training backends initialize collectively)."""
    controller.call(hosts, "add_role", role, worker_cls, cfg, dispatch="one_to_all", **kwargs)


def ray_roles(plan: Any, model_path: str) -> Roles:
    """Role hosts on Ray placement groups, colocated or disaggregated (module docstring)."""
    cfg = plan.config
    controller = plan.controller_cls.from_config(cfg)
    if not hasattr(controller, "hosts"):
        raise TypeError(f"controller {cfg.controller.name!r} cannot place roles in worker processes")
    threads = cfg.trainer.cpu_threads
    _check_nodes(controller, cfg.cluster.num_nodes)
    train = controller.hosts(controller.num_workers, name="train", cpu_threads=threads)
    pools = [train]
    backend = {"backend_cls": plan.training_backend_cls}
    _add_role(controller, train, "actor", ActorWorker, cfg, model_path=model_path, **backend)
    if _needs_reference(cfg) and not _lora(cfg):
        _add_role(controller, train, "ref", RefWorker, cfg, model_path=model_path, **backend)
    if cfg.critic.enabled:
        _add_role(controller, train, "critic", CriticWorker, cfg, model_path=_critic_path(cfg, model_path), **backend)
    rollout_hosts = train if controller.colocate else controller.hosts(
        controller.rollout_workers, name="rollout", cpu_threads=threads)
    if rollout_hosts is not train:
        pools.append(rollout_hosts)
    _add_role(controller, rollout_hosts, "rollout", RolloutWorker, cfg, model_path=model_path,
              engine_cls=plan.rollout_engine_cls)
    bucket = cfg.weight_sync.bucket_size_mb
    if controller.colocate:
        def sync(version: int) -> dict[str, float]:
            return controller.call(train, "sync_local", version, bucket, dispatch="one_to_all")[0]
    else:
        sync = _channel_sync(controller, train, rollout_hosts, bucket)
    nodes = {info["node_id"] for pool in pools for info in controller.call(pool, "info", dispatch="one_to_all")}
    client = GroupRollout(controller.view(rollout_hosts, "rollout", RolloutWorker),
                          release=controller.colocate and controller.release_rollout_memory,
                          dispatch=cfg.controller.ray.roles.get("rollout", {}).get("dispatch_mode", "dp_compute_proto"))
    ref = None
    if _needs_reference(cfg):
        ref = controller.view(train, "actor", ActorWorker) if _lora(cfg) else controller.view(train, "ref", RefWorker)
    return Roles(
        actor=controller.view(train, "actor", ActorWorker),
        ref=ref,
        critic=controller.view(train, "critic", CriticWorker) if cfg.critic.enabled else None,
        engine=client, tokenizer=load_tokenizer(cfg, model_path), sync=sync,
        release_rollout=client.release_memory, close=lambda: controller.shutdown(*pools),
        placement={"controller": "ray", "colocate": controller.colocate, "train_ranks": train.world_size,
                   "rollout_replicas": rollout_hosts.world_size, "nodes": len(nodes)},
    )


def _check_nodes(controller: Any, wanted: int) -> None:
    """``cluster.num_nodes``: the Ray cluster must have that many live nodes."""
    alive = sum(1 for node in controller.ray.nodes() if node.get("Alive"))
    if alive < wanted:
        raise RuntimeError(f"cluster.num_nodes={wanted} but the Ray cluster has {alive} live node(s); "
                           "start the workers first (scripts/launch_slurm.sh waits for them)")


def _channel_sync(controller: Any, train: WorkerGroup, rollout: WorkerGroup, bucket: int):
    """Open the weight channel (train rank 0 + R replicas) and return the sync function."""
    addr, port = controller.call(train, "free_address", dispatch="rank_zero")
    size = 1 + rollout.world_size
    opened = [controller.submit(train, "open_channel", addr, port, 0, size, dispatch="rank_zero"),
              controller.submit(rollout, "open_channel", [addr] * rollout.world_size,
                                [port] * rollout.world_size, list(range(1, size)),
                                [size] * rollout.world_size, dispatch="dp_compute")]
    for pending in opened:
        controller.wait(pending)

    def sync(version: int) -> dict[str, float]:
        send = controller.submit(train, "send_weights", version, bucket, dispatch="one_to_all")
        receive = controller.submit(rollout, "receive_weights", version, dispatch="one_to_all")
        stats = controller.wait(send)[0]
        controller.wait(receive)
        return stats

    return sync
