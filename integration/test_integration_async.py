"""``async_rl`` end to end on the tiny demo model (CPU): the on-policy mode reproduces the
synchronous trainer; a resumed async run keeps its ledger and policy version and never trains
a group twice; the rollouter as its own process, including a crash that is accounted for."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lumenrl_backends.loggers import read_metrics
from lumenrl_backends.trainers import rollouter_process
from lumenrl_core.config import ConfigError

FAST = ("eval.enabled=false", "dataset.train_batch_size=4", "policy.rollout.n=4", "trainer.warm_start_sft_steps=0",
        "logger.backends=[jsonl]", "policy.rollout.max_new_tokens=6")
LEDGER = ("async/produced", "async/consumed", "async/dropped", "async/queue_depth", "async/in_transit")


def _balanced(record: dict) -> bool:
    produced, consumed, dropped, queued, transit = (record[k] for k in LEDGER)
    return produced == consumed + dropped + queued + transit


def test_on_policy_mode_reproduces_the_synchronous_trainer(train, tmp_path):
    train("grpo_dense_bf16.yaml", tmp_path / "sync", "num_training_steps=3", *FAST)
    train("grpo_async_onpolicy.yaml", tmp_path / "async", "num_training_steps=3", *FAST)
    sync, async_ = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert len(sync) == len(async_) == 3
    for a, b in zip(sync, async_):
        for key in ("reward/mean", "actor/loss", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
        assert b["async/staleness_max"] == 0 and _balanced(b)
        # the async step's phases (its wait for samples, scoring, updates, the remainder) cover the whole step
        timed = {k: v for k, v in b.items() if k.startswith("timing/")}
        assert {"timing/wait_s", "timing/score_s", "timing/update_actor_s", "timing/other_s"} <= set(timed)
        assert -1e-6 <= b["perf/step_s"] - sum(timed.values()) <= 0.01 + 0.02 * b["perf/step_s"]


def test_on_policy_mode_reuses_the_updates_log_probs_as_the_synchronous_trainer_does(train, tmp_path):
    """``algorithm.old_log_probs=reuse``: the proximal log-probs come from the update's forward, no separate pass;
    the steps equal the synchronous trainer's with reuse, and the async run's own steps with a separate pass."""
    reuse = ("num_training_steps=2", "algorithm.old_log_probs=reuse", *FAST)
    train("grpo_dense_bf16.yaml", tmp_path / "sync", *reuse)
    train("grpo_async_onpolicy.yaml", tmp_path / "async", *reuse)
    train("grpo_async_onpolicy.yaml", tmp_path / "recompute", "num_training_steps=2", *FAST)
    sync, async_, recompute = (read_metrics(tmp_path / name) for name in ("sync", "async", "recompute"))
    for a, b, c in zip(sync, async_, recompute, strict=True):
        assert "timing/old_log_prob_s" not in b and "timing/old_log_prob_s" in c
        for key in ("reward/mean", "actor/loss", "actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
            assert b[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), key
        assert b["actor/clip_frac"] == 0.0 and _balanced(b)


def test_partial_rollout_with_kept_caches_continues_sequences_across_updates(train, tmp_path):
    """``async_training.resume_kv=keep``: sequences interrupted by a weight update continue in their engine slots on
    the cached keys and values (no prefill), their new tokens tagged with the new version; the run keeps its ledger
    and staleness bound. The default (``recompute``) continues none across an update."""
    args = ("num_training_steps=4", "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1.0",
            "policy.rollout.ignore_eos=true", "policy.optim.lr=3e-2", *FAST, "policy.rollout.max_new_tokens=48")
    train("grpo_async_partial.yaml", tmp_path / "keep", *args, "async_training.resume_kv=keep")
    train("grpo_async_partial.yaml", tmp_path / "recompute", *args)
    keep, recompute = read_metrics(tmp_path / "keep"), read_metrics(tmp_path / "recompute")
    for records in (keep, recompute):
        assert [r["step"] for r in records] == [1, 2, 3, 4] and all(_balanced(r) for r in records)
        assert all(math.isfinite(r["actor/loss"]) and r["async/staleness_max"] <= 1 for r in records)
    assert keep[-1]["async/interrupts_total"] > 0 and keep[-1]["async/partial_rollouts_total"] > 0
    assert keep[-1]["async/rollouter_kept_across_updates"] > 0
    assert recompute[-1]["async/rollouter_kept_across_updates"] == 0
    # a fresh group's first row prefills, its n - 1 = 3 siblings copy it (engines/native.py share_prefill); with
    # recompute, rows continued after an update prefill their own contexts too, with keep few do
    assert recompute[-1]["async/rollouter_shared_prefill_rows"] > 0
    assert keep[-1]["async/rollouter_shared_prefill_rows"] >= 2 * keep[-1]["async/rollouter_prefill_rows"] > 0
    assert recompute[-1]["async/rollouter_prefill_packed"] == 0  # pack_prefill=auto packs where varlen runs (CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rollouter_thread_on_its_own_cuda_stream_reproduces_the_synchronous_trainer(train, tmp_path):
    """On CUDA the rollouter thread's engine runs on a stream of its own (``rollouter_stream``) while the trainer
    computes on the default one: the on-policy mode still makes the synchronous trainer's steps, and a partial
    rollout run, where generation overlaps training, keeps its ledger, finite metrics and fresh enough samples."""
    cuda = ("cluster.device=cuda", *FAST)
    train("grpo_dense_bf16.yaml", tmp_path / "sync", "num_training_steps=3", *cuda)
    train("grpo_async_onpolicy.yaml", tmp_path / "async", "num_training_steps=3", *cuda)
    sync, async_ = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert len(sync) == len(async_) == 3 and all(_balanced(b) for b in async_)
    # step 1: the same weights and prompts, so the same samples (decode is deterministic); its loss and gradient
    # within what a GPU backward's accumulation order moves (later steps' weights then differ by that much too)
    for key in ("reward/mean", "response_length/mean"):
        assert async_[0][key] == sync[0][key], key
    for key in ("actor/loss", "actor/grad_norm"):
        assert async_[0][key] == pytest.approx(sync[0][key], rel=1e-3, abs=1e-6), key
    # eval every 3 steps: the trainer thread takes the engine on its own stream, joined to the rollouter's
    train("grpo_async_partial.yaml", tmp_path / "partial", "num_training_steps=6", *cuda, "eval.enabled=true",
          "eval.every=3", "eval.num_examples=16")
    logged = read_metrics(tmp_path / "partial")
    assert [r["step"] for r in logged if "eval/accuracy" in r] == [0, 3, 6]  # before training, then every 3 steps
    records = [r for r in logged if "actor/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 7)) and all(_balanced(r) for r in records)
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in records)
    assert records[-1]["async/consumed"] == 6 * 16 and all(r["async/staleness_max"] <= 1 for r in records)


def test_async_run_resumes_with_its_ledger_and_never_trains_a_group_twice(train, tmp_path):
    args = ("checkpointing.save_every=1", "async_training.staleness_threshold=1.0", *FAST)
    train("grpo_async_stale.yaml", tmp_path, "num_training_steps=2", *args)
    saved = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["async"]
    assert saved["policy_version"] == 2 and saved["queue"]["consumed"] == 2 * 16
    train("grpo_async_stale.yaml", tmp_path, "num_training_steps=4", "checkpointing.resume=true", *args)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(_balanced(r) for r in records)
    assert records[-1]["async/consumed"] == 4 * 16
    in_flight = saved["queue"]["produced"] - saved["queue"]["consumed"] - sum(saved["queue"]["dropped"].values())
    assert records[2].get("async/dropped_restart", 0) == in_flight  # in flight at the save: dropped, counted
    final = json.loads((tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").read_text())["async"]
    uids = final["queue"]["consumed_uids"]
    assert len(uids) == len(set(uids)) == 4 * 4  # 4 groups per step, none twice
    assert all(r["async/staleness_max"] <= 1 for r in records)


@pytest.mark.slow  # the spawned child imports torch/transformers and plans the run: ~20 s idle, minutes when loaded
def test_rollouter_process_crash_is_accounted_and_raised(train, tmp_path, monkeypatch):
    monkeypatch.setattr(rollouter_process.FAULTS, "crash_after", 6)  # the child exits abruptly after 6 groups
    with pytest.raises(RuntimeError, match="rollouter stopped") as info:
        train("grpo_async_stale.yaml", tmp_path, "num_training_steps=3", "weight_sync.method=filesystem", *FAST)
    assert "exit 3" in str(info.value)
    records = read_metrics(tmp_path)
    assert len(records) == 1 and _balanced(records[0])  # 4 groups trained, then the ledger was settled


@pytest.mark.slow  # a spawned rollouter process, as above
def test_collective_weight_sync_run_completes_with_its_ledger(train, tmp_path):
    """The rollouter process reads the weights from a gloo broadcast group (1 MB buckets)."""
    train("grpo_async_stale.yaml", tmp_path, "num_training_steps=3", "weight_sync.method=collective",
          "weight_sync.bucket_size_mb=1", *FAST)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and all(_balanced(r) for r in records)
    synced = [r for r in records if "weight_sync/version" in r]
    assert [r["weight_sync/version"] for r in synced] == [2.0, 3.0]  # every 2 steps, and the last step
    assert all(r["weight_sync/tensors"] > 0 and r["weight_sync/gb"] > 0 for r in synced)
    assert records[-1]["async/consumed"] == 3 * 16 and all(r["async/staleness_max"] <= 1 for r in records)
    last = records[-1]  # the child was spawned during the build, and built its engine before its start message
    assert last["async/rollouter_spawn_lead_s"] > 0 and last["async/rollouter_first_group_s"] > 0
    assert 0 <= last["async/startup_overlap_s"] <= last["async/rollouter_ready_s"]
    # on the CPU the engine was built before the start message: attaching took only the reader, no engine build
    assert last["async/rollouter_engine_s"] > 0 and 0 < last["async/rollouter_attach_s"] <= last["async/rollouter_first_group_s"]
    state = json.loads((tmp_path / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["async"]
    assert state["policy_version"] == 3 and state["queue"]["consumed"] == 3 * 16


def test_async_training_with_the_synchronous_trainer_is_refused(train, tmp_path):
    with pytest.raises(ConfigError, match="async_training.enabled"):
        train("grpo_dense_bf16.yaml", tmp_path, "async_training.enabled=true", *FAST)


def test_async_keys_without_async_training_are_refused(train, tmp_path):
    with pytest.raises(ConfigError, match="async_training.staleness_threshold"):
        train("grpo_dense_bf16.yaml", tmp_path, "async_training.staleness_threshold=0.5", *FAST)
    with pytest.raises(ConfigError, match="trainer.name"):
        train("grpo_async_stale.yaml", tmp_path, "async_training.enabled=false", *FAST)
