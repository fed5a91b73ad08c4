"""The async long-tail benchmark's rounds: speed-ups taken side by side within each round, reported as the median
over the rounds with the lowest and highest, rates as medians, stale drops summed."""

from __future__ import annotations

import random

import pytest
from benchmarks.async_rl.long_tail import bench, combine_rounds, overlap_bound, step_phases


def _run(rate: float, steady: float, stale: float = 0.0, reward: float = 0.5, oldest: float = 1.0,
         phases: dict | None = None) -> dict:
    return {"phases": phases or {}, "samples_per_s": rate, "steady_samples_per_s": steady, "samples_per_s_incl_build": rate / 2,
            "first_step_s": 1.0, "wall_s": 100.0 / rate, "build_s": 0.5, "dropped_stale": stale,
            "reward": [0.1, reward], "staleness_max": 1.0, "staleness_oldest_max": oldest,
            "response_length_mean": 40.0, "partial_rollouts": 3.0, "trainer_wait_s_per_step": 0.1}


def test_speedups_are_medians_of_per_round_ratios():
    rng = random.Random()
    syncs = [rng.uniform(100, 300) for _ in range(3)]
    ratios = [rng.uniform(0.5, 3.0) for _ in range(3)]
    steady = [rng.uniform(0.5, 3.0) for _ in range(3)]
    rounds = [{"sync": _run(s, s), "partial": _run(s * r, s * q, stale=8.0 * i, reward=0.1 * i, oldest=3 - i)}
              for i, (s, r, q) in enumerate(zip(syncs, ratios, steady, strict=True))]
    out = combine_rounds(rounds, ("sync", "partial"))
    # the ratio of each round's own pair, not a ratio of medians
    assert out["partial/speedup_vs_sync"] == pytest.approx(sorted(ratios)[1], abs=1e-3)
    assert out["partial/speedup_vs_sync_min"] == pytest.approx(min(ratios), abs=1e-3)
    assert out["partial/speedup_vs_sync_max"] == pytest.approx(max(ratios), abs=1e-3)
    assert out["partial/steady_speedup_vs_sync"] == pytest.approx(sorted(steady)[1], abs=1e-3)
    assert out["sync/samples_per_s"] == pytest.approx(sorted(syncs)[1], abs=1e-3)
    assert out["partial/dropped_stale"] == 0.0 + 8.0 + 16.0  # a drop in any round shows
    assert out["partial/staleness_oldest_max"] == 3  # the oldest trained token of any round
    assert out["partial/reward_last"] == pytest.approx(0.2)  # details: the last round's


def test_one_round_is_the_plain_ratio():
    out = combine_rounds([{"sync": _run(100.0, 120.0), "partial": _run(180.0, 300.0)}], ("sync", "partial"))
    assert out["partial/speedup_vs_sync"] == out["partial/speedup_vs_sync_min"] == 1.8
    assert out["partial/steady_speedup_vs_sync"] == out["partial/steady_speedup_vs_sync_max"] == 2.5


def test_rounds_below_one_are_refused():
    with pytest.raises(ValueError, match="rounds=0: allowed >= 1"):
        bench(True, rounds=0)


def test_an_unknown_model_is_refused_before_any_run():
    with pytest.raises(ValueError, match="model='7b': allowed builtin or one of tiny, 0.6b"):
        bench(True, model="7b")


def test_a_random_model_is_saved_once_and_loaded_by_every_mode(monkeypatch):
    """``model``: a random-init Qwen3 shape saved as a checkpoint with a tokenizer, every mode's run pointed at it."""
    from benchmarks.async_rl import long_tail
    from transformers import AutoConfig, AutoTokenizer

    seen = []

    def fake_run_mode(mode, *, out, extra, **shape):
        path = next(e.split("=", 1)[1] for e in extra if e.startswith("policy.model_name="))
        config = AutoConfig.from_pretrained(path)
        seen.append((mode, path, config.hidden_size, len(AutoTokenizer.from_pretrained(path)) > 0))
        assert "trainer.warm_start_sft_steps=0" in extra  # a random model is not warm-started
        return _run(100.0, 110.0)

    monkeypatch.setattr(long_tail, "run_mode", fake_run_mode)
    out = long_tail.bench(True, modes=("sync", "partial"), model="tiny")
    assert out["model"] == "tiny" and [m for m, *_ in seen] == ["sync", "partial"]
    assert len({p for _, p, *_ in seen}) == 1 and all(h == 64 and tok for *_, h, tok in seen)


def test_rounds_show_each_rate_and_the_median_phase_times():
    rng = random.Random()
    updates = [rng.uniform(0.01, 0.2) for _ in range(3)]
    rounds = [{"sync": _run(100.0 + i, 110.0 + i, phases={"generate": 0.05, "update_actor": u}),
               "partial": _run(150.0, 160.0 + i, phases={"update_actor": 2 * u, "wait": 0.01 * i})}
              for i, u in enumerate(updates)]
    out = combine_rounds(rounds, ("sync", "partial"))
    assert out["sync/rounds_steady_samples_per_s"] == "110.0 111.0 112.0"
    assert out["partial/rounds_samples_per_s"] == "150.0 150.0 150.0"
    assert out["sync/step_update_actor_s"] == pytest.approx(sorted(updates)[1], abs=1e-4)
    assert out["partial/step_update_actor_s"] == pytest.approx(2 * sorted(updates)[1], abs=1e-4)
    assert out["sync/step_generate_s"] == pytest.approx(0.05)
    assert out["partial/step_wait_s"] == pytest.approx(0.01, abs=1e-4)
    assert "partial/step_generate_s" not in out  # an async trainer does not generate
    # each round's update phase and the figures every round has, in round order
    assert out["partial/rounds_step_update_actor_s"] == " ".join(f"{2 * u:.4g}" for u in updates)
    assert out["partial/rounds_trainer_wait_s_per_step"] == "0.1 0.1 0.1"
    assert "partial/rounds_rollouter_capture_share" not in out  # no round has it


def test_step_phases_from_a_runs_metrics():
    steps = [{"timing/generate_s": 0.2, "timing/update_actor_s": 0.1 * (i + 1), "async/trainer_wait_s": 0.5 + 0.25 * i,
              "reward/mean": 0.5} for i in range(3)]
    steps[0]["timing/sync_s"] = 0.03
    got = step_phases(steps)
    assert got["generate"] == pytest.approx(0.2)
    assert got["update_actor"] == pytest.approx(0.2)
    assert got["sync"] == pytest.approx(0.01)  # run by one step of three: its cost per step
    assert got["wait"] == pytest.approx(0.25)  # not timed per step: the running total's growth per step
    assert set(got) == {"generate", "update_actor", "sync", "wait"}
    timed = [{**r, "timing/wait_s": 0.1} for r in steps]
    assert step_phases(timed)["wait"] == pytest.approx(0.1)  # a step's own timing wins
    assert step_phases([]) == {}


def test_overlap_bound_is_the_sync_step_over_its_time_outside_generation():
    rng = random.Random()
    rounds = []
    for _ in range(3):
        generate, rest = rng.uniform(0.01, 0.1), rng.uniform(0.01, 0.1)
        sync = {**_run(100.0, 110.0, phases={"generate": generate, "update_actor": rest}), "step_s": generate + rest}
        rounds.append({"sync": sync, "partial": {**_run(150.0, 160.0, phases={"wait": 0.01}), "step_s": 0.05}})
    bounds = sorted((r["sync"]["step_s"]) / (r["sync"]["step_s"] - r["sync"]["phases"]["generate"]) for r in rounds)
    out = combine_rounds(rounds, ("sync", "partial"))
    assert out["sync/overlap_bound"] == pytest.approx(bounds[1], abs=1e-3)
    assert "partial/overlap_bound" not in out  # an async trainer does not generate
    assert overlap_bound({"step_s": 0.1, "phases": {"generate": 0.1}}) == float("inf")


def test_a_failing_extra_mode_is_recorded_and_the_goals_pair_still_reported(monkeypatch):
    """``partial_thread`` (a mode with its own overrides) failing in round 1 is not run again; its error is in the
    result and the sync / partial pair is combined as usual. A failure of the goal's pair is raised."""
    from benchmarks.async_rl import long_tail

    calls = []

    def fake_run_mode(mode, **kw):
        calls.append(mode)
        if mode == "partial_thread":
            raise RuntimeError("rollouter thread died")
        return {**_run(100.0 if mode == "sync" else 150.0, 120.0 if mode == "sync" else 180.0), "step_s": 0.1}

    monkeypatch.setattr(long_tail, "run_mode", fake_run_mode)
    out = long_tail.bench(True, modes=("sync", "partial", "partial_thread"), rounds=2)
    assert calls == ["sync", "partial", "partial_thread", "sync", "partial"]
    assert out["partial_thread/error"] == "RuntimeError: rollouter thread died"
    assert out["partial/steady_speedup_vs_sync"] == 1.5
    assert [k for k in out if k.startswith("partial_thread/")] == ["partial_thread/error"]

    def broken_pair(mode, **kw):
        raise RuntimeError("partial died")

    monkeypatch.setattr(long_tail, "run_mode", broken_pair)
    with pytest.raises(RuntimeError, match="partial died"):
        long_tail.bench(True, modes=("sync", "partial"), rounds=1)


def test_the_gpu_run_warms_up_a_synchronous_and_an_async_run_untimed(monkeypatch):
    """The full GPU run: before its timed rounds, one untimed run of sync and one of the first async mode (with that
    mode's overrides: its rollouter's compiles land in the disk caches), neither among the reported rounds."""
    from benchmarks.async_rl import long_tail

    calls = []

    def fake_run_mode(mode, *, out, extra, **shape):
        calls.append((mode, out.name, extra))
        return {**_run(100.0 if mode == "sync" else 150.0, 120.0 if mode == "sync" else 180.0), "step_s": 0.1}

    monkeypatch.setattr(long_tail, "run_mode", fake_run_mode)
    out = long_tail.bench(False, gpu=True, model="builtin", modes=("sync", "partial_keep", "partial"), rounds=1,
                          async_overrides=("weight_sync.method=inprocess",))
    assert [(mode, name) for mode, name, _ in calls] == [
        ("sync", "warmup_sync"), ("partial_keep", "warmup_partial_keep"),
        ("sync", "sync0"), ("partial_keep", "partial_keep0"), ("partial", "partial0")]
    warm_async = calls[1][2]
    assert "weight_sync.method=inprocess" in warm_async and "async_training.resume_kv=keep" in warm_async
    assert "weight_sync.method=inprocess" not in calls[0][2]
    assert out["warmup_modes"] == "sync partial_keep" and out["partial/steady_speedup_vs_sync"] == 1.5


def test_overrides_reach_every_mode_and_the_record(monkeypatch):
    """``overrides`` (``--override``) go to every mode, sync included, ahead of the async modes' own; the record
    names them. ``async_overrides`` stay off the synchronous run."""
    from benchmarks.async_rl import long_tail

    calls = []

    def fake_run_mode(mode, *, out, extra, **shape):
        calls.append((mode, extra))
        return {**_run(100.0 if mode == "sync" else 150.0, 120.0 if mode == "sync" else 180.0), "step_s": 0.1}

    monkeypatch.setattr(long_tail, "run_mode", fake_run_mode)
    out = long_tail.bench(True, modes=("sync", "partial"), rounds=1, overrides=("policy.train.compile_layers=true",),
                          async_overrides=("weight_sync.method=inprocess",))
    assert [mode for mode, _ in calls] == ["sync", "partial"]
    for mode, extra in calls:
        assert "policy.train.compile_layers=true" in extra
        assert ("weight_sync.method=inprocess" in extra) == (mode != "sync")
    assert out["overrides"] == "policy.train.compile_layers=true"
