"""The rollouter in its own process (``weight_sync.method=filesystem``).

The child (``torch.multiprocessing`` spawn) plans the run again from the same config (no model
loads in planning), loads the (warm-started) policy into its own rollout engine, rebuilds the
train loader at the trainer's resume point and runs :class:`Rollouter`, sending finished groups
through a :class:`lumenrl_async.ProcessChannel` and reading weights from the atomic
:class:`lumenrl_async.FilesystemWeightSync` snapshots the trainer publishes.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch.multiprocessing as mp

from lumenrl_async import ProcessChannel

__all__ = ["start_process", "rollouter_main"]


def start_process(trainer: Any, cfg: Any) -> tuple[ProcessChannel, Any]:
    """Spawn the rollouter process for ``trainer``; returns (channel, process)."""
    ctx = mp.get_context("spawn")
    channel = ProcessChannel(ctx)
    start = {"round": trainer.start_round, "loader_state": trainer.parts.train_loader.state_dict(),
             "model_path": trainer.model_path,
             "crash_after": int(os.environ.get("LUMENRL_ASYNC_CRASH_AFTER", "0"))}
    if hasattr(trainer.weight_sync, "reader_handle"):  # cuda_ipc: the shared buffers' IPC handles
        start["cuda_ipc"] = trainer.weight_sync.reader_handle()
    else:
        start["snapshot_dir"] = str(trainer.weight_sync.root)
    proc = ctx.Process(target=rollouter_main, args=(cfg, channel, start), daemon=True, name="lumenrl-rollouter")
    proc.start()
    channel.started()
    return channel, proc


def rollouter_main(cfg: Any, channel: ProcessChannel, start: dict[str, Any]) -> None:
    """Child entry point: build an engine and a loader, run until the channel's stop event."""
    import torch

    from lumenrl_async import FilesystemWeightSync
    from lumenrl_backends.models import load_model_and_tokenizer
    from lumenrl_backends.trainers.async_rl import load_newest, make_rollouter
    from lumenrl_backends.trainers.data import make_loader, split_records
    from lumenrl_backends.trainers.rollouter import RolloutHooks
    from lumenrl_backends.training import distributed as dist_utils
    from lumenrl_core.assembly import plan_run

    if cfg.trainer.cpu_threads > 0:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    plan = plan_run(cfg)
    device = dist_utils.resolve_device(cfg.cluster.device)
    model, tokenizer = load_model_and_tokenizer(
        start["model_path"], dtype=cfg.policy.dtype, device=device, tokenizer_name=cfg.policy.tokenizer_name,
        trust_remote_code=cfg.policy.trust_remote_code)
    engine = plan.rollout_engine_cls.from_config(cfg, model=model, tokenizer=tokenizer)
    train_records, _ = split_records(cfg)
    loader = make_loader(cfg, train_records, tokenizer, batch_size=cfg.dataset.train_batch_size, seed=cfg.seed,
                         shuffle=cfg.dataset.shuffle)
    loader.load_state_dict(start["loader_state"])
    if "cuda_ipc" in start:
        from lumenrl_async.cuda_ipc import CudaIpcReader

        reader = CudaIpcReader(start["cuda_ipc"])
        newest, load = reader.latest_version, reader.load_into
    else:
        sync = FilesystemWeightSync(start["snapshot_dir"])
        newest, load = sync.latest_version, (lambda eng: load_newest(sync, eng))
    stop = threading.Event()
    sent = [0]

    def sink(group: Any) -> None:
        channel.send(group)
        sent[0] += 1
        if start["crash_after"] and sent[0] >= start["crash_after"]:
            os._exit(3)  # injected crash (tests): no cleanup, messages may be lost

    hooks = RolloutHooks(sink=sink, outstanding=channel.outstanding, newest_version=newest, load_weights=load,
                         stop=stop)
    rollouter = make_rollouter(cfg, engine, loader, hooks, start_round=start["round"])

    def watch_stop() -> None:
        while not channel.stop_requested():
            time.sleep(0.01)
        stop.set()
        engine.interrupt()

    threading.Thread(target=watch_stop, daemon=True).start()
    publisher = threading.Thread(target=_publish_stats, args=(rollouter, channel, stop), daemon=True)
    publisher.start()
    rollouter.run()
    channel.set_stats({**rollouter.stats, "round": rollouter.round})


def _publish_stats(rollouter: Any, channel: ProcessChannel, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        channel.set_stats({**rollouter.stats, "round": rollouter.round})
