"""``async_rl``: the fully asynchronous trainer (rollouter and trainer decoupled by a sample queue).

The trainer is :class:`~lumenrl_backends.trainers.loop.RLTrainer` with its rollout phase
replaced by the queue: one step (a *local update*) takes ``require_batches`` mini-batches of
whole groups, scores them, recomputes log-probs and updates exactly as the synchronous step
(same phase modules), and every ``trigger_parameter_sync_step`` steps publishes the weights
(version = step) through the run's weight sync. The rollouter
(:mod:`~lumenrl_backends.trainers.rollouter`) runs beside it:

* ``weight_sync.method=inprocess``: a thread of this process with this process's engine;
* ``weight_sync.method=filesystem`` / ``cuda_ipc`` / ``collective``: its own process
  (``torch.multiprocessing`` spawn, :mod:`.rollouter_process`) with its own engine, fed by a
  :class:`lumenrl_async.ProcessChannel`, reading atomic snapshots, (one GPU) the trainer's shared
  CUDA buffers under a seqlock, or a broadcast group (gloo / NCCL: a GPU of its own). It is spawned
  by :meth:`AsyncRLTrainer.from_plan` as soon as the policy path is known and loads the policy
  (and builds its engine, unless it shares the trainer's GPU) while the trainer builds its models; ``fit()`` sends it the start message after the first publish;
* ``controller.name=ray``: a Ray actor of its own (:mod:`.rollouter_ray`), the training roles in
  their ``RoleHost`` actors; ``collective`` or ``filesystem`` weight sync.

Staleness (``async_training.staleness_threshold`` s): the rollouter's production per window is
bounded by the StalenessController; a group more than ``ceil(s)`` syncs behind the trainer
when taken is dropped as ``stale`` (counted, never trained). With ``partial_rollout`` the lag counts
from the weights that finished the group (``staleness_from=finish``, the default) or from its oldest
token (``start``); ``async/staleness_*`` is the lag the bound applies to, ``async/staleness_oldest_*``
each trained sample's oldest token's. Off-policy: ``rollout_log_probs``
are the behaviour policy; with ``recompute_proximal_log_probs`` (default) ``old_log_probs`` are
the current policy's before the update (decoupled PPO: clip on pi/pi_prox, and the run's rollout
correction weights pi_prox/pi_behav), otherwise ``old_log_probs = rollout_log_probs``. With one
optimizer step per step and nothing that reads them before it, ``algorithm.old_log_probs=reuse``
takes the proximal log-probs from the update's own forward (that is the policy before the update)
instead of a separate forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from typing import Any

import torch

from lumenrl_async import SampleQueue, StalenessController, lag_of, versions_metrics
from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.trainers.async_weights import LocalPublisher, RayPublisher
from lumenrl_backends.trainers.build import build_parts
from lumenrl_backends.trainers.loop import RLTrainer, _mismatch_metrics
from lumenrl_backends.trainers.metrics import PhaseTimer, batch_metrics, throughput_metrics, train_tokens
from lumenrl_backends.trainers.rollout import concat_rounds
from lumenrl_backends.trainers.rollouter import Rollouter, RolloutHooks, engine_stats
from lumenrl_core.config import ConfigError
from lumenrl_core.data_proto import DataProto

__all__ = ["AsyncRLTrainer", "check_async_config", "make_rollouter"]

_METHODS = ("inprocess", "filesystem", "cuda_ipc", "collective")


def check_async_config(cfg: Any) -> None:
    """Refuse settings ``async_rl`` cannot honour (one-line ConfigError naming key, value, what is allowed)."""
    a, method = cfg.async_training, cfg.weight_sync.method
    if not a.enabled:
        raise ConfigError("async_training.enabled", False, problem="trainer.name=async_rl needs it", allowed="true")
    if cfg.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling", True, problem="not supported by async_rl yet", allowed="false")
    if method not in _METHODS:
        raise ConfigError("weight_sync.method", method, problem="not a weight sync async_rl can drive",
                          allowed="inprocess (rollouter thread), filesystem, cuda_ipc, collective (rollouter process)")
    if cfg.controller.name == "ray" and method not in ("filesystem", "collective"):
        raise ConfigError("weight_sync.method", method, problem="with controller.name=ray the rollouter is a Ray "
                          "actor of its own", allowed="collective, filesystem")
    mini = cfg.policy.train.mini_batch_size or cfg.dataset.train_batch_size * cfg.policy.rollout.n
    if mini % cfg.policy.rollout.n:
        raise ConfigError("policy.train.mini_batch_size", mini, problem="mini-batches must hold whole groups",
                          allowed=f"a multiple of policy.rollout.n ({cfg.policy.rollout.n})")


class AsyncRLTrainer(RLTrainer):
    """The ``async_rl`` trainer plugin."""

    capabilities = manifest.ASYNC_RL.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.ASYNC_RL.unavailable_reason()

    def __init__(self, parts: Any, *, plan: Any = None, model_path: str | None = None, remote: Any = None) -> None:
        """``remote``: a rollouter process already spawned while ``parts`` were built (:meth:`from_plan`)."""
        super().__init__(parts)
        cfg = self.config
        check_async_config(cfg)
        a = cfg.async_training
        self.staleness = StalenessController.from_config(cfg)
        sc = self.staleness.config
        self.sync_step, self.max_lag = a.trigger_parameter_sync_step, math.ceil(a.staleness_threshold)
        self.lag_from = a.staleness_from if a.partial_rollout else "start"  # one version per group without it
        self.groups_per_step = a.require_batches * sc.mini_batch_size // cfg.policy.rollout.n
        capacity = a.queue_size or sc.window_capacity() + sc.window_samples()
        self.queue = SampleQueue(capacity, sync_step=self.sync_step)
        self.sync_cls = plan.weight_sync_cls if plan is not None else None
        self.on_ray = cfg.controller.name == "ray"
        self.process_mode = self.on_ray or cfg.weight_sync.method != "inprocess"  # rollouter process / actor
        self.publisher = self._publisher() if plan is not None else None
        self.model_path = model_path
        self.published: int | None = None
        self.trainer_wait_s = 0.0
        self.start_round = 0
        self._t0 = time.perf_counter()
        self._started = False
        self._rollouter: Rollouter | None = None  # thread mode
        self._worker: threading.Thread | None = None
        self._remote: Any = remote  # ProcessRollouter / RayRollouter
        self._samples_trained = 0
        self._closed = False
        self.build_end = time.time()  # wall clock: the rollouter process's start-up is measured against it

    @classmethod
    def from_plan(cls, plan: Any) -> AsyncRLTrainer:
        """Build the run; a rollouter process is spawned as soon as the policy path is known, so its
        start-up overlaps the build of the trainer's models (and is stopped if that build fails)."""
        check_async_config(plan.config)
        early = _EarlyStart(plan)
        try:
            parts = build_parts(plan, on_policy_path=early)
            return cls(parts, plan=plan, model_path=early.model_path, remote=early.remote)
        except BaseException:
            early.abort()
            raise

    def close(self) -> None:
        """Stop a rollouter process spawned by :meth:`from_plan` for a trainer that is never fitted
        (``fit()`` stops everything it started at its end)."""
        if self._remote is not None and not self._started:
            self._remote.abort()

    # ------------------------------------------------------------------ weights
    def _publisher(self) -> Any:
        if self.on_ray:
            return RayPublisher(self.parts.actor, self.sync_cls, self.config)
        return LocalPublisher(self.sync_cls.from_config(self.config), self.parts.actor[0].backend,
                              self._engine_device())

    def _sync(self, version: int) -> dict[str, float]:
        if not self._started:  # resuming: the first publish is the rollouter's start (_start_rollouter)
            return {}
        if self._remote is not None and not self._remote.alive():
            self._rollouter_stopped()  # a collective publish would wait for a reader that is gone
        return self._publish(version)

    def _publish(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        stats = self.publisher.publish(int(version))
        self.published = int(version)
        return {**stats, "timing/sync_s": time.perf_counter() - start, "weight_sync/version": float(version)}

    def _engine_device(self) -> torch.device:
        from lumenrl_backends.training import distributed as dist_utils

        return dist_utils.resolve_device(self.config.cluster.device)

    # ------------------------------------------------------------------ rollouter
    def _start_rollouter(self) -> None:
        self._started = True
        if self.process_mode:
            self._start_remote()
            return
        sync = self.publisher.writer  # InProcessWeightSync: the thread reads what the trainer publishes
        self._publish(self.step)
        hooks = RolloutHooks(sink=lambda g: self.queue.put(g), ledger=self._thread_ledger,
                             newest_version=sync.latest_version, load_weights=sync.load_into)
        self._rollouter = make_rollouter(self.config, self.parts.engine, self.parts.train_loader, hooks,
                                         start_round=self.start_round)
        self._stream = rollouter_stream(self.parts.engine)
        self._worker = threading.Thread(target=self._guarded_run, daemon=True, name="rollouter")
        self._worker.start()

    def _start_remote(self) -> None:
        """A rollouter process (local controller; spawned by :meth:`from_plan` unless built otherwise) or
        Ray actor, reading the run's weight sync. The process gets its start message once the first weights
        are published (or, ``collective``, before the publish that forms the group)."""
        from lumenrl_backends.trainers.rollouter_process import (
            ProcessRollouter,
            boot_args,
            rollouter_device,
            start_args,
        )

        collective = "collective" in self.sync_cls.capabilities
        if not collective:  # snapshots / IPC buffers exist before the reader opens them
            self._publish(self.step)
        handle = self.publisher.reader_handle()
        if self.on_ray:
            from lumenrl_backends.trainers.rollouter_ray import RayRollouter

            start = start_args(self, handle, None)
            self._remote = RayRollouter(self.parts.actor.controller, self.config, start)
        else:
            device = rollouter_device(self.config, self.sync_cls)
            if self._remote is None:
                self._remote = ProcessRollouter(self.config, boot_args(self.config, self.model_path, device))
            if not self._remote.start(start_args(self, handle, device)):
                self._rollouter_stopped()  # died during start-up: its reason is in exit_info()
        if collective:  # the first publish forms the group: wait for the reader (on Ray: registered in add_role)
            if not self.on_ray:
                try:
                    self.publisher.wait_for_readers(self._remote.alive)
                except RuntimeError:
                    self._rollouter_stopped()
            self._publish(self.step)
        self._remote.begin(self.queue)
        self.parts.placement.update(self._remote.placement())
        self.parts.announce(f"async rollouter: {self._remote.placement()}")

    def _guarded_run(self) -> None:
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                self._rollouter.run()
        except BaseException as exc:  # surfaced by the trainer's next get()
            self._rollouter_error = exc
            raise

    _rollouter_error: BaseException | None = None
    _stream: Any = None  # thread mode on CUDA: the rollouter's stream (rollouter_stream)

    def _alive(self) -> bool:
        if self._remote is not None:
            return self._remote.alive()
        return self._worker is not None and self._worker.is_alive()

    def _stop_rollouter(self) -> None:
        if self._rollouter is not None:
            self._rollouter.hooks.stop.set()
            self.parts.engine.interrupt()
            self._worker.join(timeout=60)
            self.parts.engine.resume()
        elif self._remote is not None:
            self.publisher.close(notify=self._remote.alive())  # a broadcast group's readers leave it
            self._remote.stop(self.queue)
        self.queue.close()
        self.queue.drop_queued("shutdown")
        self.queue.check()
        self.parts.announce(f"async ledger: {_fmt_ledger(self.queue.metrics())}")

    def _evaluate(self) -> dict[str, float]:
        """Greedy eval on this run's own engine with the newest published weights: in thread mode
        the rollouter is interrupted and paused meanwhile (its in-flight rows resume after)."""
        if self.parts.evaluator is None:
            return {}
        engine = self.parts.engine
        if self._rollouter is None:
            if self.process_mode and self.published is not None:  # the engine(s) serving eval only
                self.parts.sync(self.published)
            return super()._evaluate()
        engine.interrupt()
        with self._rollouter.lock, joined_streams(self._stream):
            engine.resume()
            self.publisher.writer.load_into(engine)
            return super()._evaluate()

    def rollouter_stats(self) -> dict[str, float]:
        if self._remote is not None:
            return self._remote.stats()
        return {**self._rollouter.stats, **engine_stats(self.parts.engine)} if self._rollouter is not None else {}

    # ------------------------------------------------------------------ one step
    def _thread_ledger(self) -> tuple[int, int]:
        """The rollouter thread's view of the queue: (outstanding, stale drops); only that thread
        adds to ``produced``, so reading it after the snapshot is consistent."""
        taken, stale = self.queue.ledger()
        return self.queue.produced - taken, stale

    def _take(self) -> list[Any]:
        start = time.perf_counter()
        take = functools.partial(self.queue.get, self.groups_per_step, current_version=self.published,
                                 max_lag=self.max_lag, lag_from=self.lag_from)
        groups = take(alive=self._alive)
        if groups is None and self._remote is not None and not self._settled and not self._remote.alive():
            # a rollouter process that ended: the groups it sent before it ended may still be in its channel (the
            # pump had not moved them yet, likelier on a busy machine); receive them and train on a step's worth
            # before raising (the next take raises)
            self._settle_remote()
            groups = take(alive=lambda: False)
        self.trainer_wait_s += time.perf_counter() - start
        if groups is None:
            self._rollouter_stopped()
        return groups

    _settled = False  # a rollouter process's end was settled (its channel drained into the queue)

    def _settle_remote(self) -> None:
        if not self._settled:
            self._remote.settle_crash(self.queue)
            self._settled = True

    def _rollouter_stopped(self) -> None:
        """The rollouter ended on its own: settle the ledger (``rollouter_crash``) and raise."""
        if self._remote is not None:
            self._settle_remote()
            info = self._remote.exit_info()
        else:
            info = f"thread error {self._rollouter_error!r}"
        self.queue.check()
        raise RuntimeError(f"async_rl: the rollouter stopped ({info}); ledger {self.queue.metrics()}")

    def train_step(self, step: int) -> dict[str, float]:
        timer, cfg = PhaseTimer(), self.config
        with timer("wait"):
            groups = self._take()
        oldest = [lag_of(self.published, v, self.sync_step) for g in groups for v in g.versions]  # per sample
        lags = oldest if self.lag_from == "start" else [g.lag(self.published, self.sync_step, self.lag_from)
                                                        for g in groups for _ in g.versions]
        if max(lags) > self.max_lag:
            raise AssertionError(f"staleness bound broken: lag {max(lags)} > {self.max_lag}")
        with timer("score"):  # as the synchronous trainer's phase of that name, plus joining the groups
            batch = concat_rounds([g.payload for g in groups], pad_token_id=int(self.parts.tokenizer.pad_token_id or 0))
            metrics = dict(self.parts.scorer(batch))
        metrics.update(versions_metrics(lags))
        metrics.update(versions_metrics(oldest, prefix="async/staleness_oldest"))  # each sample's oldest token
        metrics.update(batch_metrics(batch, cfg.policy.rollout.max_new_tokens))
        self._log_probs(batch, timer)
        metrics.update(_mismatch_metrics(batch))
        metrics.update(self._update(batch, timer))
        if step % self.sync_step == 0 or step == self.total_steps:  # the last step too: eval sees it
            metrics.update(self._sync(step))
        self.queue.check()
        self._samples_trained += len(batch)
        metrics.setdefault("actor/kl", math.nan)
        metrics.update(timer.metrics(metrics))  # with timing/other_s: what no phase covers
        metrics.update(throughput_metrics(
            generated_tokens=int(batch.batch["response_mask"].sum()), generate_s=0.0,
            train_tokens=train_tokens(batch, cfg.policy.train.ppo_epochs),
            train_s=timer.seconds.get("update_actor", 0.0), step_s=timer.elapsed()))
        metrics.pop("perf/rollout_tokens_per_s", None)  # the rollouter's rate is reported below
        metrics.update(self._async_metrics(groups))
        return metrics

    def _log_probs(self, batch: DataProto, timer: PhaseTimer) -> None:
        if self.config.async_training.recompute_proximal_log_probs:
            self._compute_log_probs(batch, timer)
            return
        batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()  # behaviour policy as the anchor
        p = self.parts
        batch.meta_info["temperature"] = float(p.sampling["temperature"]) or 1.0
        if p.ref is not None:
            with timer("ref"):
                batch.union(p.ref.call("compute_ref_log_prob", batch))
        if p.critic is not None:
            with timer("values"):
                batch.union(p.critic.call("compute_values", batch))

    def _async_metrics(self, groups: list[Any]) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        stats = self.rollouter_stats()
        out = dict(self.queue.metrics())
        out.update({
            "async/trainer_idle_ratio": self.trainer_wait_s / wall,
            "async/rollouter_idle_ratio": stats.get("idle_s", 0.0) / wall,
            "async/partial_rollouts": float(sum(g.meta.get("partial", 0) for g in groups)),
            "async/partial_rollouts_total": stats.get("partial_rollouts", 0.0),
            "async/interrupts_total": stats.get("interrupts", 0.0),
            "async/refills_total": stats.get("refills", 0.0),
            "async/rollouter_calls_total": stats.get("calls", 0.0),
            "async/rollouter_busy_s_total": stats.get("busy_s", 0.0),
            "async/rollouter_prefill_s_total": stats.get("prefill_s", 0.0),
            "async/budget_refunds_total": stats.get("budget_refunds", 0.0),
            "async/policy_version": float(self.published),
            "perf/samples_per_s": self._samples_trained / wall,
            "perf/rollout_tokens_per_s": stats.get("tokens", 0.0) / max(stats.get("busy_s", 0.0), 1e-9),
            "async/trainer_wait_s": self.trainer_wait_s,
        })
        for key in ("graph_captures", "graph_capture_s", "graph_recorded",  # the rollouter engine's CUDA graphs
                    "kept_reclaimed", "kept_across_updates",  # rows continued in their kept slots (native engine)
                    "prefill_rows", "shared_prefill_rows",  # rows admitted by a prefill / by a shared one's copy
                    "prefill_eager", "prefill_eager_s", "prefill_packed",  # prefills at their own shape (no graph)
                    "prefill_wait_s"):  # the host's wait for admitted rows' first tokens
            if key in stats:
                out[f"async/rollouter_{key}"] = stats[key]
        startup = getattr(self._remote, "startup_metrics", None)  # a rollouter process's start-up
        if startup is not None:
            out.update(startup(self.build_end))
        return out

    # ------------------------------------------------------------------ run / checkpoint
    def fit(self) -> dict[str, Any]:
        self._t0 = time.perf_counter()
        close_roles = self.parts.close

        def close() -> None:  # the rollouter stops before the training roles' actors (ray) go
            if self._closed:
                return
            self._closed = True
            try:
                if self._started:
                    self._stop_rollouter()
                else:
                    self.close()
            finally:
                close_roles()

        self.parts.close = close
        try:
            return super().fit()
        finally:
            close()

    def _resume(self) -> None:
        super()._resume()
        latest = self.checkpoints.latest() if self.config.checkpointing.resume else None
        if latest is not None:
            import json

            state = json.loads((latest / "trainer_state.json").read_text()).get("async", {})
            if state:
                self.queue.load_state_dict(state["queue"])
                self.start_round = int(state["round"])
        self._start_rollouter()

    def _save(self, step: int) -> None:
        self.checkpoints.save(
            step, backends=self._backends(), dataloader_state=self._loader_state(),
            trainer_state={**self._trainer_state(),
                           "async": {"queue": self.queue.state_dict(), "round": self._round(),
                                     "policy_version": self.published}})

    def _round(self) -> int:
        """The rollouter's prompt round at its newest delivered group (paired with its loader state)."""
        return int(self.queue.last_meta.get("reader_round", self.start_round))

    def _loader_state(self) -> dict[str, Any]:
        return self.queue.last_meta.get("loader_state") or self.parts.train_loader.state_dict()


def rollouter_stream(engine: Any) -> torch.cuda.Stream | None:
    """The rollouter thread's CUDA stream (None off CUDA): the engine's work goes to a stream of its own, so the
    GPU can run it beside the trainer's (default stream) instead of after it. The thread enters it as its current
    stream (PyTorch's current stream is per thread). The loop needs no events of its own: every generate call ends
    by waiting for its stream, the engine's outputs are host tensors, and the in-process weight sync's device copies
    carry the publisher's event, which the reader's stream waits for (``InProcessWeightSync.latest``). The one
    other user of the engine, eval, holds the rollouter's lock and joins the two streams (:func:`joined_streams`):
    a weight load the rollouter queued before it may still be copying."""
    device = getattr(engine, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.Stream(torch.device(device))


@contextlib.contextmanager
def joined_streams(stream: torch.cuda.Stream | None) -> Any:
    """This thread's work on the engine waits for what ``stream`` queued before it, and ``stream``'s later work
    waits for this thread's (a no-op for None)."""
    if stream is None:
        yield
        return
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    try:
        yield
    finally:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


class _EarlyStart:
    """``on_policy_path`` of :func:`build_parts`: spawns the rollouter process (local controller, a
    cross-process weight sync) with the policy path, before the trainer's models load."""

    def __init__(self, plan: Any) -> None:
        self.plan, self.model_path, self.remote = plan, None, None

    def __call__(self, model_path: str) -> None:
        from lumenrl_backends.trainers.rollouter_process import ProcessRollouter, boot_args, rollouter_device

        self.model_path = model_path
        cfg = self.plan.config
        if cfg.controller.name == "ray" or cfg.weight_sync.method == "inprocess":
            return  # a Ray actor (started from fit) or a thread of this process
        device = rollouter_device(cfg, self.plan.weight_sync_cls)
        self.remote = ProcessRollouter(cfg, boot_args(cfg, model_path, device))

    def abort(self) -> None:
        if self.remote is not None:
            self.remote.abort()


def _fmt_ledger(m: dict[str, float]) -> str:
    drops = ", ".join(f"{k.split('dropped_')[1]} {int(v)}" for k, v in m.items() if "dropped_" in k) or "none"
    return f"produced {int(m['async/produced'])} = consumed {int(m['async/consumed'])} + dropped {int(m['async/dropped'])} ({drops})"


def make_rollouter(cfg: Any, engine: Any, loader: Any, hooks: RolloutHooks, *, start_round: int) -> Rollouter:
    from lumenrl_backends.trainers.build import _sampling

    if cfg.async_training.resume_kv == "keep":  # an engine with kept_kv_across_updates (assembly checked it)
        engine.keep_kv_on_update = True
    return Rollouter(
        engine=engine, next_prompts=loader.next_batch, sampling=_sampling(cfg), n=cfg.policy.rollout.n,
        run_seed=cfg.seed, budget=StalenessController.from_config(cfg), hooks=hooks,
        partial_rollout=cfg.async_training.partial_rollout,
        max_rows=max(cfg.policy.rollout.max_batch_size, cfg.dataset.train_batch_size * cfg.policy.rollout.n),
        start_round=start_round, loader_state=loader.state_dict,
    )

