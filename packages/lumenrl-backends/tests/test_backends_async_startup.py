"""``async_rl``'s rollouter process starts while the trainer builds (CPU, ``weight_sync.method=filesystem``).

From recorded wall-clock times: the child is spawned, and alive, before the trainer's training roles
finish building; a trainer whose build fails, or that is closed unfitted, leaves no child behind (its pid
is gone); a child that dies during its start-up is reported by ``fit()`` with its exception.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lumenrl_backends.trainers import build
from lumenrl_backends.trainers import rollouter_process as rp
from lumenrl_core.assembly import plan_run
from lumenrl_core.config import load_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_async_stale.yaml"
ARGS = ("num_training_steps=2", "trainer.warm_start_sft_steps=0", "dataset.train_batch_size=4", "policy.rollout.n=4",
        "policy.rollout.max_new_tokens=6", "logger.progress_bar=false", "logger.backends=[jsonl]",
        "eval.enabled=false", "checkpointing.enabled=false", "checkpointing.export_hf=false",
        "weight_sync.method=filesystem")


def _trainer(tmp_path):
    plan = plan_run(load_config(CONFIG, [f"trainer.output_dir={tmp_path}", *ARGS]))
    return plan.trainer_cls.from_plan(plan)


@pytest.fixture
def spawned(monkeypatch) -> list:
    """Every ProcessRollouter spawned during the test."""
    out, real = [], rp.ProcessRollouter.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        out.append(self)

    monkeypatch.setattr(rp.ProcessRollouter, "__init__", init)
    return out


def _gone(child) -> bool:
    """The child exited and was reaped: no process has its pid any more."""
    if child.proc.is_alive() or child.proc.exitcode is None:
        return False
    try:
        os.kill(child.proc.pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_rollouter_process_starts_before_the_training_roles_are_built(tmp_path, monkeypatch, spawned):
    real, seen = build.local_roles, {}

    def roles(plan, model_path):
        out = real(plan, model_path)
        seen["built"], seen["alive"] = time.time(), [child.alive() for child in spawned]
        return out

    monkeypatch.setattr(build, "local_roles", roles)
    trainer = _trainer(tmp_path)
    try:
        (child,) = spawned
        assert child.startup.at("spawned") < seen["built"] <= trainer.build_end
        assert seen["alive"] == [True]  # building its engine while the trainer built its models
        assert trainer._remote is child and not trainer._started  # it waits for fit()'s start message
        assert child.startup_metrics(trainer.build_end)["async/rollouter_spawn_lead_s"] > 0
    finally:
        trainer.close()
    assert _gone(child)


def test_on_the_trainers_gpu_the_engine_is_built_after_the_start_message():
    """Its KV cache is sized from free memory, which the trainer's models must already have taken."""
    assert rp.engine_waits_for_start({"device": None}, torch.device("cuda:0"))  # the trainer's GPU (cuda_ipc)
    assert not rp.engine_waits_for_start({"device": "cuda:1"}, torch.device("cuda:1"))  # its own GPU (collective)
    assert not rp.engine_waits_for_start({"device": None}, torch.device("cpu"))


def test_a_failed_trainer_build_stops_the_early_started_process(tmp_path, monkeypatch, spawned):
    def roles(plan, model_path):
        raise RuntimeError("the actor could not be built")

    monkeypatch.setattr(build, "local_roles", roles)
    with pytest.raises(RuntimeError, match="the actor could not be built"):
        _trainer(tmp_path)
    (child,) = spawned
    assert _gone(child)


@pytest.mark.slow  # the child imports torch/transformers before it reaches its device: ~20 s on 2 loaded cores
def test_a_rollouter_dying_during_start_up_is_reported_with_its_reason(tmp_path, monkeypatch, spawned):
    real = rp.boot_args
    monkeypatch.setattr(rp, "boot_args", lambda cfg, path, device: real(cfg, path, "cuda:999"))  # no such device
    trainer = _trainer(tmp_path)
    with pytest.raises(RuntimeError, match=r"rollouter stopped \(exit 1: \w+: .+\)"):
        trainer.fit()
    (child,) = spawned
    assert _gone(child)


class _EndedRollouterProcess:
    """A rollouter process that ended with groups it had sent still in its channel (the pump had not moved them)."""

    def __init__(self, groups) -> None:
        self.in_channel, self.settles = list(groups), 0

    def alive(self) -> bool:
        return False

    def settle_crash(self, queue) -> None:  # receives what the channel holds, as ProcessRollouter.settle_crash
        self.settles += 1
        for group in self.in_channel:
            queue.put(group)
        self.in_channel = []

    def exit_info(self) -> str:
        return "exit 3"


def test_groups_an_ended_rollouter_process_sent_are_trained_before_its_end_is_raised():
    """The child sent three groups and exited before the trainer's pump moved them into the queue (a race a busy
    machine makes likely): the trainer receives them, trains a step of two, and raises at the next step, whose
    groups never come; the end is settled once."""
    from lumenrl_async import SampleQueue
    from lumenrl_async.queue import SampleGroup
    from lumenrl_backends.trainers.async_rl import AsyncRLTrainer

    trainer = object.__new__(AsyncRLTrainer)  # only what _take reads
    trainer.queue, trainer.trainer_wait_s = SampleQueue(), 0.0
    trainer.groups_per_step, trainer.published, trainer.max_lag, trainer.lag_from = 2, 0, 1, "start"
    trainer._remote = remote = _EndedRollouterProcess(
        SampleGroup(uid=f"g{i}", payload=b"", versions=(0, 0)) for i in range(3))
    assert [g.uid for g in trainer._take()] == ["g0", "g1"] and remote.settles == 1
    with pytest.raises(RuntimeError, match=r"rollouter stopped \(exit 3\)"):
        trainer._take()
    assert remote.settles == 1 and trainer.queue.consumed == 4
