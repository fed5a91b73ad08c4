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
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from lumenrl_async import ProcessChannel, SampleQueue
from lumenrl_core.config import ConfigError
from lumenrl_core.data_proto import DataProto

__all__ = ["ProcessRollouter", "build_rollouter", "rollouter_main", "start_args"]


def start_args(trainer: Any, reader_handle: Any, device: str | None) -> dict[str, Any]:
    """What a rollouter process needs from the trainer (picklable)."""
    return {"round": trainer.start_round, "loader_state": trainer.parts.train_loader.state_dict(),
            "model_path": trainer.model_path, "reader": reader_handle, "device": device}


def build_rollouter(cfg: Any, start: dict[str, Any], *, sink: Callable[[Any], None], outstanding: Callable[[], int],
                    stop: threading.Event) -> tuple[Any, Any, Any]:
    """In the rollouter's process: ``(rollouter, engine, weight reader)`` (module docstring)."""
    from lumenrl_backends.models import load_model_and_tokenizer
    from lumenrl_backends.trainers.async_rl import make_rollouter
    from lumenrl_backends.trainers.data import make_loader, split_records
    from lumenrl_backends.trainers.rollouter import RolloutHooks
    from lumenrl_backends.training import distributed as dist_utils
    from lumenrl_core.assembly import plan_run

    if cfg.trainer.cpu_threads > 0:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    plan = plan_run(cfg)
    device = torch.device(start["device"]) if start.get("device") else dist_utils.resolve_device(cfg.cluster.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the engine's "cuda" is this device
    model, tokenizer = load_model_and_tokenizer(
        start["model_path"], dtype=cfg.policy.dtype, device=device, tokenizer_name=cfg.policy.tokenizer_name,
        trust_remote_code=cfg.policy.trust_remote_code)
    engine = plan.rollout_engine_cls.from_config(cfg, model=model, tokenizer=tokenizer)
    train_records, _ = split_records(cfg)
    loader = make_loader(cfg, train_records, tokenizer, batch_size=cfg.dataset.train_batch_size, seed=cfg.seed,
                         shuffle=cfg.dataset.shuffle)
    loader.load_state_dict(start["loader_state"])
    reader = plan.weight_sync_cls.reader(start["reader"], device=device)
    hooks = RolloutHooks(sink=sink, outstanding=outstanding, newest_version=reader.latest_version,
                         load_weights=reader.load_into, stop=stop)
    return make_rollouter(cfg, engine, loader, hooks, start_round=start["round"]), engine, reader


def rollouter_main(cfg: Any, channel: ProcessChannel, start: dict[str, Any]) -> None:
    """Child entry point: build, run until the channel's stop flag, close the weight reader."""
    stop, sent = threading.Event(), [0]

    def sink(group: Any) -> None:
        channel.send(group)
        sent[0] += 1
        if start.get("crash_after") and sent[0] >= start["crash_after"]:
            os._exit(3)  # injected crash (tests): no cleanup, messages may be lost

    rollouter, engine, reader = build_rollouter(cfg, start, sink=sink, outstanding=channel.outstanding, stop=stop)

    def watch_stop() -> None:
        while not channel.stop_requested():
            time.sleep(0.01)
        stop.set()
        engine.interrupt()

    threading.Thread(target=watch_stop, daemon=True).start()
    threading.Thread(target=_publish_stats, args=(rollouter, channel, stop), daemon=True).start()
    try:
        rollouter.run()
    finally:
        channel.set_stats({**rollouter.stats, "round": rollouter.round})
        if hasattr(reader, "close"):
            reader.close()


def _publish_stats(rollouter: Any, channel: ProcessChannel, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        channel.set_stats({**rollouter.stats, "round": rollouter.round})


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
    """The trainer's side of a spawned rollouter process (the interface :class:`RayRollouter` shares)."""

    def __init__(self, cfg: Any, start: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.channel = ProcessChannel(ctx)
        start = {**start, "crash_after": int(os.environ.get("LUMENRL_ASYNC_CRASH_AFTER", "0"))}
        self.proc = ctx.Process(target=rollouter_main, args=(cfg, self.channel, start), daemon=True,
                                name="lumenrl-rollouter")
        self.proc.start()
        self.channel.started()
        self._pump: threading.Thread | None = None
        self._done = threading.Event()

    def begin(self, sample_queue: SampleQueue) -> None:
        """The child runs from its start; here: move its messages into ``sample_queue``."""
        self._pump = self.channel.pump(sample_queue, DataProto.from_bytes, self._done)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stats(self) -> dict[str, float]:
        return self.channel.read_stats()

    def placement(self) -> dict[str, Any]:
        return {"rollouter": "process", "rollouter_pid": self.proc.pid}

    def exit_info(self) -> str:
        return f"exit {self.proc.exitcode}"

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
