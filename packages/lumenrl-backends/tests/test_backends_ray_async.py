"""``async_rl`` under the Ray controller: the rollouter and the trainer are separate Ray actors.

The training roles live in a ``RoleHost`` actor, the rollouter in another one (its own placement
group), the driver runs only the loop; weights go from the training actor to the rollouter actor
over the collective (gloo) broadcast group, samples come back through the polled outbox. The
ledger balances at every step and the rollouter's process is neither the driver's nor the trainer's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lumenrl_backends.loggers import read_metrics  # noqa: E402
from lumenrl_core.assembly import plan_run  # noqa: E402
from lumenrl_core.config import ConfigError, load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_async_stale.yaml"
ARGS = ("num_training_steps=3", "trainer.warm_start_sft_steps=0", "dataset.train_batch_size=4", "policy.rollout.n=4",
        "policy.rollout.max_new_tokens=6", "logger.progress_bar=false", "logger.backends=[jsonl]",
        "eval.enabled=false", "checkpointing.export_hf=false", "async_training.trigger_parameter_sync_step=1",
        "controller.name=ray", "controller.ray.num_cpus_per_worker=1", "weight_sync.method=collective")
LEDGER = ("async/produced", "async/consumed", "async/dropped", "async/queue_depth", "async/in_transit")


def test_rollouter_and_trainer_are_separate_ray_actors(ray_cluster, tmp_path):
    plan = plan_run(load_config(CONFIG, [f"trainer.output_dir={tmp_path}", *ARGS]))
    trainer = plan.trainer_cls.from_plan(plan)
    train_pid = ray.get(trainer.parts.actor[0].info.remote())["pid"]  # the training RoleHost actor
    trainer.fit()
    where = trainer.parts.placement
    assert where["controller"] == "ray" and where["rollouter"] == "ray_actor"
    assert len({where["rollouter_pid"], train_pid, os.getpid()}) == 3  # three processes
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        produced, consumed, dropped, queued, transit = (r[k] for k in LEDGER)
        assert produced == consumed + dropped + queued + transit and r["async/staleness_max"] <= 1
    assert [r["weight_sync/version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["weight_sync/tensors"] > 0 for r in records) and records[-1]["async/consumed"] == 3 * 16
    assert records[-1]["async/produced"] >= 3 * 16 and records[-1]["perf/rollout_tokens_per_s"] > 0


def test_a_weight_sync_that_cannot_reach_an_actor_is_refused(tmp_path):
    from lumenrl_backends.trainers.async_rl import check_async_config
    from lumenrl_core.assembly import AssemblyError

    with pytest.raises(AssemblyError, match="weight_sync.method='inprocess': weight sync lacks capability 'cross_node'"):
        plan_run(load_config(CONFIG, [f"trainer.output_dir={tmp_path}", *ARGS, "weight_sync.method=inprocess"]))
    with pytest.raises(ConfigError, match="'weight_sync.method' = 'cuda_ipc': with controller.name=ray"):
        check_async_config(load_config(CONFIG, [*ARGS, "weight_sync.method=cuda_ipc"], machine=False))
