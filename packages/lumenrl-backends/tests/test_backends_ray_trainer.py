"""The GRPO demo through the Ray controller: colocated and disaggregated placement, two "nodes",
a killed actor and the resume from the last checkpoint.

Every run is seeded and compared with the same run under the local controller (one process):
rewards exactly (data-parallel rollout reproduces the single engine's samples), losses and
gradient norms to fp32 reduction-order tolerance (two FSDP2 ranks sum gradients in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lumenrl_backends.controllers.ray import WorkerDiedError  # noqa: E402
from lumenrl_backends.loggers import read_metrics  # noqa: E402
from lumenrl_core.assembly import plan_run  # noqa: E402
from lumenrl_core.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_dense_bf16.yaml"
BASE = (
    "num_training_steps=2", "trainer.warm_start_sft_steps=20", "dataset.train_batch_size=4", "policy.rollout.n=4",
    "logger.progress_bar=false", "logger.backends=[jsonl]", "eval.enabled=false", "checkpointing.export_hf=false",
)
RAY = ("controller.name=ray", "controller.ray.num_cpus_per_worker=1")


def trainer(out: Path, *overrides: str):
    plan = plan_run(load_config(CONFIG, [f"trainer.output_dir={out}", *BASE, *overrides]))
    return plan.trainer_cls.from_plan(plan)


def assert_matches(reference: list[dict], got: list[dict], rel: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for a, b in zip(reference, got):
        assert b["reward/mean"] == a["reward/mean"]
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=rel, abs=1e-7)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=rel, abs=1e-7)


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("local")
    trainer(out).fit()
    metrics = read_metrics(out)
    assert any(r["reward/mean"] > 0 for r in metrics)  # the warm-started policy earns reward: a real signal
    return metrics


def test_colocated_two_ranks_on_two_nodes_match_the_local_controller(reference, tmp_path):
    t = trainer(tmp_path, *RAY, "controller.ray.num_workers=2", "controller.ray.placement_strategy=STRICT_SPREAD")
    assert t.parts.placement["nodes"] == 2 and t.parts.placement["rollout_replicas"] == 2
    t.fit()
    got = read_metrics(tmp_path)
    assert_matches(reference, got, rel=1e-4)
    assert all(r["rollout/kv_cache_freed_gb"] > 0 for r in got)  # colocated: the cache is freed for training


def test_disaggregated_pools_sync_over_the_channel_and_match(reference, tmp_path):
    t = trainer(tmp_path, *RAY, "controller.ray.colocate=false", "controller.ray.rollout_workers=1")
    assert t.parts.placement["colocate"] is False and t.parts.placement["rollout_replicas"] == 1
    t.fit()
    got = read_metrics(tmp_path)
    assert_matches(reference, got, rel=1e-6)
    assert [r["weight_sync/version"] for r in got] == [1.0, 2.0]
    assert all(r["weight_sync/tensors"] > 0 for r in got)


def test_killed_actor_names_role_and_rank_and_the_run_resumes(reference, tmp_path):
    args = (*RAY, "checkpointing.save_every=1", "checkpointing.resume=true")
    t = trainer(tmp_path, *args)
    release = t.parts.release_rollout

    def kill_in_step_two() -> dict:  # mid-step: after generation, before the training phases
        out = release()
        if t.step == 1:
            ray.kill(t.parts.actor[0], no_restart=True)
        return out

    t.parts.release_rollout = kill_in_step_two
    with pytest.raises(WorkerDiedError, match=r"'actor' rank 0 died during 'compute_log_prob'"):
        t.fit()
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_000001"]  # the last checkpoint is intact, no partial step 2
    resumed = trainer(tmp_path, *args)
    resumed.fit()
    assert resumed.step == 2
    got = read_metrics(tmp_path)
    assert_matches(reference, got, rel=1e-6)  # step 1 kept from the first run, step 2 from the resume
