"""Every suite entry in smoke mode (tiny shapes, CPU): it runs and returns its declared numbers, finite.

Also: the suite's names are unique and well formed, RESULTS.md renders from a history, and smoke
runs are not recorded in the history.
"""

from __future__ import annotations

import json

import pytest
from benchmarks.history import check_numbers, render_results
from benchmarks.suite import ENTRIES, entries


@pytest.fixture(autouse=True)
def _bench_out(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_BENCH_OUT", str(tmp_path))  # detail JSON into the test's folder
    monkeypatch.setenv("LUMENRL_CACHE", str(tmp_path / "cache"))


def test_suite_is_well_formed():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    for e in ENTRIES:
        assert e.device in ("cuda", "cpu") and e.suites and e.target.startswith("benchmarks.")
        for _goal, metric, bound in e.goals():
            assert metric and bound.split(" ")[0] in (">=", "<=")
            float(bound.split(" ")[1])
        assert not e.more_goals or e.goal  # further goals only beside a main one
    assert {e.name for e in entries("smoke")} == set(names)
    assert all("gpu" in e.suites for e in entries("gpu"))


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_entry_smoke(entry):
    numbers = entry.load()(True)
    assert check_numbers(entry, numbers) == []
    assert numbers, f"{entry.name} returned nothing"


def test_results_render_current_figure_per_goal():
    goal = next(e for e in ENTRIES if e.goal)
    value = float(goal.bound.split(" ")[1])
    history = [
        {"date": "2026-01-01T00:00:00Z", "commit": "aaa", "hardware": "H", "command": "old", "entry": goal.name,
         "numbers": {goal.metric: value * 0.5}},
        {"date": "2026-02-01T00:00:00Z", "commit": "bbb", "hardware": "H", "command": "a | b", "entry": goal.name,
         "numbers": {goal.metric: value}},
    ]
    text = render_results(json.loads(json.dumps(history)))
    row = next(line for line in text.splitlines() if f"`{goal.name}`" in line)
    assert "bbb" in row and "aaa" not in row and "| yes |" in row and "a \\| b" in row
    assert text.count("not measured") == sum(len(e.goals()) for e in ENTRIES) - len(goal.goals())
    extra = next(e for e in ENTRIES if e.more_goals)  # a second goal of an entry gets its own row
    assert f"| {extra.more_goals[0][1]} {extra.more_goals[0][2]} |" in text


def test_results_show_the_spread_of_the_last_three_runs():
    goal = next(e for e in ENTRIES if e.goal)
    other = next(e for e in ENTRIES if e.goal and e.name != goal.name)
    # four runs of the entry, out of date order in the file, and one of another entry in between
    values = {"2026-01-04": 4.0, "2026-01-01": 100.0, "2026-01-03": 2.0, "2026-01-02": 3.0}
    history = [{"date": f"{d}T00:00:00Z", "commit": d[-2:], "hardware": "H", "command": "c", "entry": goal.name,
                "numbers": {goal.metric: v}} for d, v in values.items()]
    history.insert(2, {"date": "2026-01-05T00:00:00Z", "commit": "zz", "hardware": "H", "command": "c",
                       "entry": other.name, "numbers": {other.metric: 50.0}})
    row = next(line for line in render_results(history).splitlines() if f"`{goal.name}`" in line)
    assert "| 2 .. 4 (3 runs) |" in row  # the oldest run (100) is not among the last three
    row = next(line for line in render_results(history).splitlines() if f"`{other.name}`" in line)
    assert "| 1 run |" in row
    # a later run on other hardware is the row's figure, and no re-run of the earlier hardware's runs
    history.append({"date": "2026-01-06T00:00:00Z", "commit": "h2", "hardware": "H2", "command": "c",
                    "entry": goal.name, "numbers": {goal.metric: 9.0}})
    rows = [line for line in render_results(history).splitlines() if f"`{goal.name}`" in line]
    assert len(rows) == 2 and "| 9 | " in rows[0] and "| 1 run |" in rows[0] and "| H2 |" in rows[0]
    assert "| 2 .. 4 (3 runs) |" in rows[1] and "| H |" in rows[1]


def test_results_count_only_records_since_the_entry_last_changed():
    """An entry whose workload changed (``Entry.since``): its older records are neither a row's figure nor part of
    its spread, and RESULTS.md says so; the history keeps them."""
    changed = next(e for e in ENTRIES if e.since)
    old = {"date": "2000-01-01T00:00:00Z", "commit": "old", "hardware": "OLDGPU", "command": "c", "entry": changed.name,
           "numbers": {changed.metric: 1e9}}
    new = [{"date": changed.since, "commit": f"n{i}", "hardware": "NEWGPU", "command": "c", "entry": changed.name,
            "numbers": {changed.metric: 1.0 + i}} for i in range(2)]
    text = render_results([old, *new])
    rows = [line for line in text.splitlines() if line.startswith("| ") and f"`{changed.name}`" in line]
    assert rows and all("OLDGPU" not in r and "| old |" not in r for r in rows)
    assert "| 1 .. 2 (2 runs) |" in rows[0]  # the old record (1e9) is not in the spread either
    assert f"`{changed.name}` since {changed.since[:10]}" in text
    assert "Only records since" not in render_results(new)  # nothing older to leave out: no note


def _fake_bench(smoke: bool) -> dict:
    return {"value": 1.0 if smoke else 2.0}


def _pid_bench(smoke: bool) -> dict:
    import os

    return {"value": 1.0, "pid": os.getpid()}


def _broken_bench(smoke: bool) -> dict:
    raise RuntimeError("broken on purpose")


def test_a_full_run_runs_each_entry_in_a_fresh_interpreter(tmp_path, monkeypatch, capfd):
    """So an entry's figures do not depend on the entries run before it in the same job."""
    import os

    from benchmarks import history
    from benchmarks.suite import Entry

    monkeypatch.setattr(history, "HISTORY", tmp_path / "history.jsonl")
    monkeypatch.delenv("LUMENRL_BENCH_OUT", raising=False)
    pid = Entry(name="pid", target=f"{__name__}:_pid_bench", suites=("cpu",), numbers=("value",), device="cpu")
    broken = Entry(name="broken", target=f"{__name__}:_broken_bench", suites=("cpu",), device="cpu")
    assert history.run_entries([pid, broken, pid], smoke=False, command="c") == 1  # the broken one, not the others
    first, second = history.read_history(tmp_path / "history.jsonl")
    assert os.getpid() not in (first["numbers"]["pid"], second["numbers"]["pid"])
    assert first["numbers"]["pid"] != second["numbers"]["pid"]  # one process per entry
    assert "broken on purpose" in capfd.readouterr().err  # its traceback is shown


def test_smoke_runs_are_not_recorded_full_runs_are(tmp_path, monkeypatch):
    from benchmarks import history
    from benchmarks.suite import Entry

    monkeypatch.setattr(history, "HISTORY", tmp_path / "history.jsonl")
    monkeypatch.setenv("LUMENRL_BENCH_OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    fake = Entry(name="fake", target=f"{__name__}:_fake_bench", suites=("cpu",), numbers=("value",), device="cpu")
    assert history.run_entries([fake], smoke=True, command="smoke") == 0
    assert history.read_history(tmp_path / "history.jsonl") == []
    assert history.run_entries([fake], smoke=False, command="python -m benchmarks run cpu") == 0
    (rec,) = history.read_history(tmp_path / "history.jsonl")
    assert rec["entry"] == "fake" and rec["numbers"] == {"value": 2.0} and rec["command"].startswith("python -m")
    assert {"date", "commit", "hardware", "seconds"} <= set(rec)
    # the copy a GPU job brings back merges once
    monkeypatch.setattr(history, "HISTORY", tmp_path / "other.jsonl")
    assert history.merge(tmp_path / "out" / "history_new.jsonl") == 1
    assert history.merge(tmp_path / "out" / "history_new.jsonl") == 0


# the goals measured before the harness existed, seeded into the history with their original date and commit
SEEDED_GOALS = {"decode", "decode_vs_hf", "fp8_rollout", "weight_sync", "train", "grpo_step_vs_trl", "quantize",
                "fp8_training", "rollout_kl_trained"}


def test_seeded_history_covers_every_goal():
    from benchmarks.history import read_history

    recorded = {r["entry"] for r in read_history()}
    goals = {e.name for e in ENTRIES if e.goal}
    assert goals >= SEEDED_GOALS and recorded >= SEEDED_GOALS
    assert recorded <= {e.name for e in ENTRIES}  # every record names a suite entry


def test_lumenrl_bench_forwards_inside_a_checkout_and_refuses_outside(tmp_path, monkeypatch, capsys):
    from lumenrl_backends.cli import main as lumenrl_main

    assert lumenrl_main(["bench", "list"]) == 0  # pytest runs from the repository root
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LUMENRL_REPO", raising=False)
    assert lumenrl_main(["bench", "list"]) == 2
    assert "checkout" in capsys.readouterr().err


def test_train_profile_classes_name_the_kernels_of_a_training_step():
    """Names as an H200 profile of the 1.7B step shows them; cuDNN's SDPA kernels also say ``sm90_``."""
    from benchmarks.gpu.bench_train import _train_kernel_class

    assert _train_kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert _train_kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert _train_kernel_class("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert _train_kernel_class("triton_red_fused__to_copy_add_amax_div_exp_gather_logsumexp_0") == "inductor"
    assert _train_kernel_class("Memcpy DtoD (Device -> Device)") == "copy"


def test_decode_profile_classes_and_overlapping_kernels():
    """The engine's decode GEMM kernel is a GEMM, an inductor kernel whose fused name mentions the op is not;
    busy time counts overlapping (PDL) kernels once."""
    from benchmarks.gpu._common import covered_us, kernel_class

    assert kernel_class("_decode_linear_kernel") == "gemm"
    assert kernel_class("triton_red_fused__to_copy_add_decode_linear_mean_mul_pow_rsqrt_view_8") == "inductor"
    assert covered_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17.0
    assert covered_us([(3, 4)]) == 1.0 and covered_us([]) == 0.0


def test_marginal_time_sums_to_busy_and_skips_waits():
    """A PDL kernel that starts early is charged only from its predecessor's end; a kernel inside another's
    interval is charged nothing; the marginal times sum to the union, on random intervals too."""
    import random

    from benchmarks.gpu._common import covered_us, marginal_us

    assert marginal_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == [10, 2, 5, 0]
    assert marginal_us([]) == []
    rng = random.Random(7)
    for _ in range(50):
        spans = [(a, a + rng.uniform(0, 5)) for a in (rng.uniform(0, 30) for _ in range(rng.randint(1, 12)))]
        own = marginal_us(spans)
        assert min(own) >= 0 and abs(sum(own) - covered_us(spans)) < 1e-9


def test_a_forward_compiled_in_pieces_stops_a_benchmark(tmp_path):
    """The engine's warning that compile="full" fell back to a piecewise forward is an error inside the suite: no
    figure of a degraded engine reaches the history."""
    import subprocess
    import sys
    from pathlib import Path

    from lumenrl_backends.engines.whole_graph import WholeGraph

    root = Path(__file__).resolve().parents[2]
    code = ("import benchmarks, torch, torch._dynamo\n"
            "from lumenrl_backends.engines.whole_graph import WholeGraph\n"
            "def f(x):\n    torch._dynamo.graph_break()\n    return x + 1\n"
            "WholeGraph(f, what='test forward')(torch.ones(2))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "does not compile as one graph" in run.stderr
    import torch._dynamo

    def doubled(x: float) -> float:
        torch._dynamo.graph_break()
        return x * 2

    with pytest.warns(UserWarning, match="does not compile as one graph"):  # elsewhere a warning, and the value
        assert WholeGraph(doubled, what="t")(3.0) == 6.0


def test_host_profile_ranks_a_steps_functions_by_own_time():
    """``bench_grpo_step --cprofile-step``: the step's slow host function comes first, with its call count."""
    import time

    from benchmarks.gpu.bench_grpo_step import host_profile

    class Trainer:
        def train_step(self, step: int) -> None:
            for _ in range(3):
                self.slow()
            sum(range(1000))

        def slow(self) -> None:
            time.sleep(0.01)

    rows = host_profile(Trainer(), 7, top=3)
    assert len(rows) == 3 and rows[0]["function"].endswith("(<built-in method time.sleep>)")
    assert rows[0]["calls"] == 3 and rows[0]["own_ms"] >= 25.0


def test_grpo_entry_records_the_collectors_pauses():
    """``grpo_step_vs_trl`` keeps LumenRL's garbage-collector pauses per timed step beside its phases (a host stall
    no profiler range names), so the history says whether they are part of the step's idle time."""
    from benchmarks.gpu import bench_grpo_trl

    numbers = bench_grpo_trl.run(True)
    assert numbers["gc/ms_per_step"] >= 0 and numbers["gc/max_ms"] >= 0 and "gc/full_per_step" in numbers


def test_train_gemm_groups_time_both_ways_and_check_equal_results():
    import torch
    from benchmarks.gpu.bench_train import gemm_groups

    rows = gemm_groups("smoke", 64, torch.device("cpu"), rounds=2, iters=1)
    assert {(r["group"], r["mode"], r["round"]) for r in rows} == {
        (g, m, r) for g in ("qkv", "gate_up") for m in ("separate", "grouped") for r in (0, 1)}
    assert all(r["us"] > 0 for r in rows)


def test_train_sdpa_variant_compiles_under_its_backend():
    import torch
    from benchmarks.gpu.bench_train import VARIANTS, sdpa_priority
    from torch.nn.attention import SDPBackend

    assert VARIANTS["1.7b/bf16+compile+single+flash"][2]["sdpa"] == "flash"
    with sdpa_priority("efficient"):
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.EFFICIENT_ATTENTION)
        assert torch._inductor.config.force_disable_caches  # no graph compiled under another backend is reused
    assert not torch._inductor.config.force_disable_caches
    with sdpa_priority(None):
        assert not torch._inductor.config.force_disable_caches
