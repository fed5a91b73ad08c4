"""The chain-level tuner of ``bench_decode_linear.py --tune-chain``: which launch configurations it tries per shape,
and a run of the tuner itself on the tiny shapes (CPU: the op's torch path, so its times mean nothing there)."""

from __future__ import annotations

from benchmarks.gpu import bench_decode_linear as bench


def test_candidates_are_the_table_the_fastest_and_their_lean_versions():
    table = {"block_n": 32, "block_k": 128, "num_stages": 6, "num_warps": 4}
    ranked = [{"us": 10.0, "config": {"block_n": 64, "block_k": 128, "num_stages": 5, "num_warps": 4, "split": 1}},
              {"us": 11.0, "config": {**table, "split": 1}},  # the table's launch as the sweep names it
              {"us": 12.0, "config": {"block_n": 32, "block_k": 64, "num_stages": 3, "num_warps": 4, "split": 1}}]
    found = bench.chain_candidates(table, ranked, swiglu=False, top=3)
    assert found[0] == table and not any(bench.same_config(a, b) for i, a in enumerate(found) for b in found[:i])
    assert ranked[0]["config"] in found and ranked[2]["config"] in found
    lean = [c for c in found if bench.smem_bytes(c, False) <= bench.TWO_PER_SM]
    # every configuration too large for two programs per multiprocessor has a lean version with fewer stages
    for cfg in found:
        if bench.smem_bytes(cfg, False) > bench.TWO_PER_SM:
            assert any(c["num_stages"] < cfg["num_stages"] and {**c, "num_stages": 0} == {**cfg, "num_stages": 0}
                       for c in lean), cfg
    assert all(c["num_stages"] >= 2 for c in found)
    # SwiGLU tiles hold two weight tiles per stage
    assert bench.smem_bytes(table, True) > bench.smem_bytes(table, False)


def test_the_tuner_runs_and_reports_its_ab_rounds(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMENRL_BENCH_OUT", str(tmp_path))
    shapes = bench.TINY
    key = (shapes["down"][0], shapes["down"][1], False)
    ranked = {key: [{"us": 1.0, "config": {"block_n": 32, "block_k": 64, "num_stages": 2, "num_warps": 4}}]}
    out = bench.tune_chain(shapes, m=4, layers=1, ranked=ranked, passes=1, rounds=2)
    assert len(out["table_ms"]) == len(out["tuned_ms"]) == 2 and all(ms > 0 for ms in out["table_ms"])
    assert any(t["shape"] == list(key) for t in out["trials"])  # the ranked candidate was timed in the chain
    assert set(out["changed"]) <= {str(key)}
