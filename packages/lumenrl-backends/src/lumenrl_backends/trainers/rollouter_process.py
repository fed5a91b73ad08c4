"""The rollouter outside the trainer's process: how it is built there, and the spawned-process form.

:func:`build_rollouter` runs in the rollouter's own process (a ``torch.multiprocessing`` spawn
child here, a Ray actor in :mod:`.rollouter_ray`): it plans the run again from the same config (no
model loads in planning), loads the (warm-started) policy into its own rollout engine, rebuilds
the train loader at the trainer's resume point and opens the reading side of the run's weight
sync (``weight_sync.method``: atomic ``filesystem`` snapshots, ``cuda_ipc`` shared buffers on
one GPU, or a ``collective`` broadcast group).

:class:`ProcessRollouter` is the trainer's handle on a spawned child: finished groups come back
through a :class:`lumenrl_async.ProcessChannel`. A ``collective`` rollouter on CUDA takes the
device after the trainer's (NCCL cannot put both members on one GPU).

Start-up in two stages, so the child's start-up overlaps the trainer's build: the child is spawned
as soon as the policy path is known (:meth:`AsyncRLTrainer.from_plan`, before the trainer loads its
models) with :func:`boot_args` only, and builds what it can (:func:`build_before_start`: imports, CUDA
context, model load, loader, engine; on the trainer's own GPU the engine waits for the start message,
since it sizes its KV cache from the memory the trainer leaves free); it then waits for the start message (:func:`start_args`:
resume round, loader state, weight reader handle), which the trainer sends from ``fit()`` once the
first weights are published, and only then opens the reader and runs (:func:`attach_rollouter`): it
never generates before it has loaded a published version. The phases' wall-clock times and the
reason of a failure live in shared memory (:class:`Startup`), so a child that dies during start-up is
reported with its exception. The child comes from the rollouter server (:mod:`lumenrl_backends.rollouter_server`: a
forkserver that has imported torch, transformers and LumenRL, started early by ``lumenrl train``), so
it starts with those imports done; it takes the trainer's environment and ``sys.path`` at its
creation, as a spawned child would. Compiled kernels are shared through the disk caches: with the
trainer's environment, Triton's and inductor's cache directories are the trainer's.

Test-only fault injection: :data:`FAULTS` (a :class:`Faults`; no config key or environment variable sets it)
makes a child crash after some groups or find CUDA unusable after its fork. Tests in the trainer's process set
it (``monkeypatch.setattr(rollouter_process.FAULTS, "crash_after", 6)``); :class:`ProcessRollouter` reads it
when it creates a child and passes it on in the child's boot arguments.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lumenrl_async import ProcessChannel, SampleQueue
from lumenrl_backends.rollouter_server import adopt_caller_state, caller_state, context
from lumenrl_backends.trainers.rollouter import engine_stats
from lumenrl_core.config import ConfigError
from lumenrl_core.data_proto import DataProto

__all__ = ["FAULTS", "PHASES", "Built", "Faults", "ProcessRollouter", "Startup", "attach_rollouter", "boot_args", "build_before_start",
           "build_rollouter", "engine_waits_for_start", "rollouter_main", "start_args"]

# a rollouter process's start-up; "attached": engine (if not built before), weight reader and rollouter ready to run
PHASES = ("spawned", "running", "ready", "started", "attached", "first_group")


@dataclass(slots=True)
class Faults:
    """Faults a test injects into the rollouter children :class:`ProcessRollouter` creates from then on (test-only;
    a run never sets them)."""

    crash_after: int = 0  # the child exits abruptly (``os._exit(3)``, no cleanup) after sending this many groups; 0: never
    forked_cuda_fails: bool = False  # a child forked from the rollouter server finds CUDA unusable (as after a
    # CUDA-initializing import in the server), so the trainer replaces it by a spawned one


FAULTS = Faults()  # tests: monkeypatch.setattr(FAULTS, "crash_after", 6)


def boot_args(cfg: Any, model_path: str, device: str | None) -> dict[str, Any]:
    """What a rollouter process needs to build its engine (picklable; known before the trainer's models load),
    with the caller's environment and ``sys.path`` (:func:`~lumenrl_backends.rollouter_server.caller_state`)."""
    return {"model_path": model_path, "device": device, "caller": caller_state()}


def start_args(trainer: Any, reader_handle: Any, device: str | None) -> dict[str, Any]:
    """What a rollouter needs from the trainer to run (picklable): resume point and weight reader."""
    return {"round": trainer.start_round, "loader_state": trainer.parts.train_loader.state_dict(),
            "model_path": trainer.model_path, "reader": reader_handle, "device": device}


@dataclass(kw_only=True)
class Built:
    """What a rollouter process builds before its start message (:func:`build_before_start`)."""

    plan: Any
    model: Any
    tokenizer: Any
    loader: Any
    device: torch.device
    engine: Any = None  # None: built at the start message (:func:`engine_waits_for_start`)
    engine_s: float = 0.0  # seconds the engine's construction took (wherever it ran)


def engine_waits_for_start(boot: dict[str, Any], device: torch.device) -> bool:
    """On the trainer's own GPU the engine sizes its KV cache from the free memory
    (``policy.rollout.gpu_memory_utilization``), which is only right once the trainer's models are
    loaded: then the engine is built at the start message, after the trainer's build."""
    return device.type == "cuda" and not boot.get("device")


def build_before_start(cfg: Any, boot: dict[str, Any]) -> Built:
    """In the rollouter's process: plan, the (warm-started) policy loaded, the train loader and, unless it
    must wait for the start message, the rollout engine."""
    from lumenrl_backends.models import load_model_and_tokenizer
    from lumenrl_backends.trainers.build import set_host_threads
    from lumenrl_backends.trainers.data import make_loader, split_records
    from lumenrl_backends.training import distributed as dist_utils
    from lumenrl_core.assembly import plan_run

    device = torch.device(boot["device"]) if boot.get("device") else dist_utils.resolve_device(cfg.cluster.device)
    set_host_threads(cfg.trainer.cpu_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the engine's "cuda" is this device
    plan = plan_run(cfg)
    model, tokenizer = load_model_and_tokenizer(
        boot["model_path"], dtype=cfg.policy.dtype, device=device, tokenizer_name=cfg.policy.tokenizer_name,
        trust_remote_code=cfg.policy.trust_remote_code)
    train_records, _ = split_records(cfg)
    loader = make_loader(cfg, train_records, tokenizer, batch_size=cfg.dataset.train_batch_size, seed=cfg.seed,
                         shuffle=cfg.dataset.shuffle)
    built = Built(plan=plan, model=model, tokenizer=tokenizer, loader=loader, device=device)
    set_host_threads(cfg.trainer.cpu_threads, device)
    if not engine_waits_for_start(boot, device):
        built.engine = _engine(cfg, built)
    return built


def _engine(cfg: Any, built: Built) -> Any:
    start = time.perf_counter()
    engine = built.plan.rollout_engine_cls.from_config(cfg, model=built.model, tokenizer=built.tokenizer)
    built.engine_s = time.perf_counter() - start
    return engine


def attach_rollouter(cfg: Any, built: Built, start: dict[str, Any], *, sink: Callable[[Any], None],
                     ledger: Callable[[], tuple[int, int]], stop: threading.Event) -> tuple[Any, Any, Any]:
    """The built engine at the trainer's resume point, reading the run's weight sync: ``(rollouter, engine, reader)``."""
    from lumenrl_backends.trainers.async_rl import make_rollouter
    from lumenrl_backends.trainers.rollouter import RolloutHooks

    engine = built.engine if built.engine is not None else _engine(cfg, built)
    built.loader.load_state_dict(start["loader_state"])
    reader = built.plan.weight_sync_cls.reader(start["reader"], device=built.device)
    hooks = RolloutHooks(sink=sink, ledger=ledger, newest_version=reader.latest_version,
                         load_weights=reader.load_into, stop=stop)
    return make_rollouter(cfg, engine, built.loader, hooks, start_round=start["round"]), engine, reader


def build_rollouter(cfg: Any, start: dict[str, Any], *, sink: Callable[[Any], None], ledger: Callable[[], tuple[int, int]],
                    stop: threading.Event) -> tuple[Any, Any, Any]:
    """In the rollouter's process, in one go: ``(rollouter, engine, weight reader)`` (module docstring)."""
    return attach_rollouter(cfg, build_before_start(cfg, start), start, sink=sink, ledger=ledger, stop=stop)


class Startup:
    """The child's start-up, shared with the parent: wall-clock times of :data:`PHASES` (0: not reached),
    the reason it failed, and the pipe the start message comes through."""

    def __init__(self, ctx: Any) -> None:
        self.times = ctx.Array("d", len(PHASES))
        self.forked_cuda_failed = ctx.Value("b", 0)  # 1: forked from the server, it found CUDA unusable
        self.engine_s = ctx.Value("d", 0.0)  # seconds its rollout engine's construction took
        self.reason = ctx.Array("c", 1024)
        self.inbox, self.outbox = ctx.Pipe(duplex=False)

    def mark(self, phase: str) -> None:
        self.times[PHASES.index(phase)] = time.time()

    def at(self, phase: str) -> float:
        return float(self.times[PHASES.index(phase)])

    def fail(self, exc: BaseException) -> None:
        self.reason.value = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:1023]

    def wait_start(self, channel: ProcessChannel) -> dict[str, Any] | None:
        """The start message, or None when the parent asked to stop first."""
        while not channel.stop_requested():
            if self.inbox.poll(0.05):
                return self.inbox.recv()
        return None


def rollouter_main(cfg: Any, channel: ProcessChannel, boot: dict[str, Any], startup: Startup) -> None:
    """Child entry point: build the engine, wait for the start message, run until the channel's stop
    flag, close the weight reader. A failure is recorded in ``startup`` (its reason) and re-raised."""
    try:
        if boot.get("caller"):
            adopt_caller_state(boot["caller"])
        if boot.get("forked"):
            _check_cuda_after_fork(cfg, boot, startup)
        _main(cfg, channel, boot, startup)
    except BaseException as exc:
        startup.fail(exc)
        raise


_FORK_CUDA_ERRORS = ("forked subprocess", "initialization error")  # torch's bad-fork guard; CUDA_ERROR_NOT_INITIALIZED


def _check_cuda_after_fork(cfg: Any, boot: dict[str, Any], startup: Startup) -> None:
    """A child forked from the rollouter server, bound for a GPU, first takes its device: had a module the
    server imported initialized CUDA there, CUDA is unusable in a fork. It then says so and exits, and
    :meth:`ProcessRollouter.start` spawns a fresh child instead (any other failure is the run's own)."""
    from lumenrl_backends.training import distributed as dist_utils

    device = torch.device(boot["device"]) if boot.get("device") else dist_utils.resolve_device(cfg.cluster.device)
    try:
        if boot.get("forked_cuda_fails"):  # injected (tests, FAULTS): what a CUDA-initializing import in the server causes
            raise RuntimeError("CUDA error: initialization error (injected)")
        if device.type != "cuda":
            return
        torch.cuda.set_device(device)  # what the build does first; here with the failure told apart
        torch.empty(1, device=device)
    except Exception as exc:
        if torch.cuda._is_in_bad_fork() or any(text in str(exc) for text in _FORK_CUDA_ERRORS):  # noqa: SLF001
            startup.forked_cuda_failed.value = 1
            raise RuntimeError(f"CUDA is unusable in a process forked from the rollouter server: {exc}") from exc
        raise


def _start_profile() -> Callable[[], None]:
    """``LUMENRL_ROLLOUTER_PROFILE=PATH``: the child's start-up (build to first group) under cProfile, its
    statistics to PATH (``pstats``) and the top functions by cumulative time to PATH.txt; else nothing."""
    path = os.environ.get("LUMENRL_ROLLOUTER_PROFILE")
    if not path:
        return lambda: None
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()

    def finish() -> None:
        profiler.disable()
        profiler.dump_stats(path)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
        with open(f"{path}.txt", "w") as f:
            f.write(text.getvalue())

    return finish


def _main(cfg: Any, channel: ProcessChannel, boot: dict[str, Any], startup: Startup) -> None:
    stop, sent = threading.Event(), [0]
    profiled = _start_profile()

    def sink(group: Any) -> None:
        channel.send(group)
        sent[0] += 1
        if sent[0] == 1:
            startup.mark("first_group")
            profiled()
        if boot.get("crash_after") and sent[0] >= boot["crash_after"]:
            os._exit(3)  # injected crash (tests, FAULTS): no cleanup, messages may be lost

    startup.mark("running")
    built = build_before_start(cfg, boot)
    startup.mark("ready")
    start = startup.wait_start(channel)
    if start is None:
        return
    startup.mark("started")
    rollouter, engine, reader = attach_rollouter(cfg, built, start, sink=sink, ledger=channel.ledger,
                                                 stop=stop)
    startup.engine_s.value = built.engine_s
    startup.mark("attached")

    def watch_stop() -> None:
        while not channel.stop_requested():
            time.sleep(0.01)
        stop.set()
        engine.interrupt()

    threading.Thread(target=watch_stop, daemon=True).start()
    threading.Thread(target=_publish_stats, args=(rollouter, engine, channel, stop), daemon=True).start()
    try:
        rollouter.run()
    finally:
        channel.set_stats({**rollouter.stats, "round": rollouter.round, **engine_stats(engine)})
        if hasattr(reader, "close"):
            reader.close()


def _publish_stats(rollouter: Any, engine: Any, channel: ProcessChannel, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        channel.set_stats({**rollouter.stats, "round": rollouter.round, **engine_stats(engine)})


def rollouter_device(cfg: Any, weight_sync_cls: Any) -> str | None:
    """The child's device: the trainer's (None: resolved alike), except ``collective`` on CUDA: the next GPU."""
    from lumenrl_backends.training import distributed as dist_utils

    device = dist_utils.resolve_device(cfg.cluster.device)
    if "collective" not in weight_sync_cls.capabilities or device.type != "cuda":
        return None
    index = (device.index or 0) + 1
    if index >= torch.cuda.device_count():
        raise ConfigError("weight_sync.method", cfg.weight_sync.method, problem=(
            f"the rollouter process needs a GPU of its own (cuda:{index}; {torch.cuda.device_count()} visible, NCCL "
            "cannot join two members on one GPU)"), allowed="cuda_ipc (one GPU), controller.name=ray, cluster.device=cpu")
    return f"cuda:{index}"


class ProcessRollouter:
    """The trainer's side of a rollouter process (the interface :class:`RayRollouter` shares)."""

    def __init__(self, cfg: Any, boot: dict[str, Any]) -> None:
        """Start the child with ``boot`` (:func:`boot_args`): it builds what it can, then waits for :meth:`start`.
        The caller does not wait for the rollouter server to finish its imports: the child is asked for from a
        thread (:attr:`proc` waits for it)."""
        self._cfg = copy.deepcopy(cfg)  # pickled by the launching thread while the trainer builds
        self._boot = {**boot, "crash_after": FAULTS.crash_after, "forked_cuda_fails": FAULTS.forked_cuda_fails}
        self._pump: threading.Thread | None = None
        self._done = threading.Event()
        self.fell_back_to_spawn = False
        self._launch(context())

    def _launch(self, ctx: Any) -> None:
        self.channel = ProcessChannel(ctx)
        self.startup = Startup(ctx)
        self._forked = ctx.get_start_method() == "forkserver"
        boot = {**self._boot, "forked": self._forked}
        self._proc = ctx.Process(target=rollouter_main, args=(self._cfg, self.channel, boot, self.startup), daemon=True,
                                 name="lumenrl-rollouter")
        self._launch_error: BaseException | None = None
        self.startup.mark("spawned")
        self._launcher = threading.Thread(target=self._start_child, daemon=True, name="lumenrl-rollouter-launch")
        self._launcher.start()

    def _start_child(self) -> None:
        try:
            self._proc.start()  # forkserver: returns once the server, its imports done, has forked the child
            self.channel.started()
            self.startup.inbox.close()  # the child holds its own copy
        except BaseException as exc:  # raised to the caller by .proc
            self._launch_error = exc

    @property
    def proc(self) -> Any:
        """The child's ``multiprocessing.Process``, once it exists."""
        self._launcher.join()
        if self._launch_error is not None:
            raise RuntimeError(f"the rollouter process could not be started: {self._launch_error}") from self._launch_error
        return self._proc

    def start(self, start: dict[str, Any]) -> bool:
        """Send the start message (:func:`start_args`); False when the child is gone (see :meth:`exit_info`).
        A forked child that found CUDA unusable (a module imported by the server had initialized it) is
        replaced by a spawned one, which then gets the message."""
        if not self.alive() and self._launch_error is not None:
            return False
        proc = self.proc
        while proc.is_alive() and not self.startup.at("running"):
            proc.join(0.01)  # its CUDA check comes first
        if not proc.is_alive() and self.startup.forked_cuda_failed.value:
            warnings.warn(f"rollouter: {self.exit_info()}; starting a spawned rollouter instead", RuntimeWarning,
                          stacklevel=2)
            self.fell_back_to_spawn = True
            self._launch(torch.multiprocessing.get_context("spawn"))
            proc = self.proc
        if not proc.is_alive():
            return False
        try:
            self.startup.outbox.send(start)
        except OSError:  # it died meanwhile
            proc.join(5.0)  # its exit code for exit_info()
            return False
        return True

    def abort(self, timeout: float = 10.0) -> None:
        """Stop a child that was never started (its trainer failed to build or to start): nothing to receive."""
        self.channel.request_stop()
        try:
            proc = self.proc
        except RuntimeError:  # it never started
            return
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()

    def startup_metrics(self, build_end: float) -> dict[str, float]:
        """Seconds of the child's start-up against the trainer's build end (wall clock, ``time.time()``):
        ``spawn_lead_s`` (> 0: spawned before the build ended), ``ready_s`` (spawn to ready for the start message),
        ``startup_overlap_s`` (the part of that before the build ended), ``first_group_s`` (start message to
        its first finished group: first weight load and generate call, CUDA graph captures included), of which
        ``attach_s`` (start message to ready to run: the engine if it waited for the message, the weight reader),
        ``engine_s`` (the engine's construction, before or after the message);
        ``forked`` (1: forked from the rollouter server, its imports done; 0: spawned)."""
        at = self.startup.at
        spawned, ready = at("spawned"), at("ready")
        out = {"async/rollouter_spawn_lead_s": build_end - spawned}
        if at("running"):
            out["async/rollouter_boot_s"] = at("running") - spawned
            out["async/rollouter_forked"] = float(self._forked)
        if ready:
            out["async/rollouter_ready_s"] = ready - spawned
            out["async/startup_overlap_s"] = max(0.0, min(ready, build_end) - spawned)
        if at("first_group") and at("started"):
            out["async/rollouter_first_group_s"] = at("first_group") - at("started")
        if at("attached") and at("started"):
            out["async/rollouter_attach_s"] = at("attached") - at("started")
            out["async/rollouter_engine_s"] = float(self.startup.engine_s.value)
        return out

    def begin(self, sample_queue: SampleQueue) -> None:
        """The child runs from its start; here: move its messages into ``sample_queue``."""
        self._pump = self.channel.pump(sample_queue, DataProto.from_bytes, self._done)

    def alive(self) -> bool:
        try:
            return self.proc.is_alive()
        except RuntimeError:  # it never started
            return False

    def stats(self) -> dict[str, float]:
        return self.channel.read_stats()

    def placement(self) -> dict[str, Any]:
        return {"rollouter": "process", "rollouter_pid": self.proc.pid}

    def exit_info(self) -> str:
        if not self.alive() and self._launch_error is not None:
            return f"not started: {type(self._launch_error).__name__}: {self._launch_error}"
        reason = self.startup.reason.value.decode("utf-8", "replace")
        return f"exit {self.proc.exitcode}" + (f": {reason}" if reason else "")

    def _stop_pump(self) -> None:
        self._done.set()
        if self._pump is not None:
            self._pump.join()

    def settle_crash(self, sample_queue: SampleQueue) -> None:
        """It stopped on its own: what it counted but never delivered is dropped (``rollouter_crash``)."""
        self._stop_pump()
        self.channel.drain(sample_queue, DataProto.from_bytes, closing=True)
        self.channel.settle(sample_queue, "rollouter_crash")

    def stop(self, sample_queue: SampleQueue, timeout: float = 60.0) -> None:
        """Ask it to stop, receive what it flushes (dropped: ``shutdown``), kill it if it hangs."""
        self._stop_pump()
        self.channel.request_stop()
        deadline = time.monotonic() + timeout
        while self.proc.is_alive() and time.monotonic() < deadline:  # the child flushes its pipe at exit
            self.channel.drain(sample_queue, DataProto.from_bytes, closing=True)
            self.proc.join(timeout=0.05)
        if self.proc.is_alive():
            self.proc.kill()
        self.channel.drain(sample_queue, DataProto.from_bytes, closing=True)
        self.channel.settle(sample_queue, "shutdown")
