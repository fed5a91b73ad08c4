"""The chain-level tuner of ``bench_decode_linear.py --tune-chain``: which launch configurations it tries per shape,
and a run of the tuner itself on the tiny shapes (CPU: the op's torch path, so its times mean nothing there)."""

from __future__ import annotations

from benchmarks.gpu import bench_decode_linear as bench


def test_candidates_are_the_table_the_fastest_and_their_lean_versions():
    table = {"block_n": 32, "block_k": 128, "num_stages": 6, "num_warps": 4}
    ranked = [{"us": 10.0, "config": {"block_n": 64, "block_k": 128, "num_stages": 5, "num_warps": 4, "split": 1}},
              {"us": 11.0, "config": dict(table)},
              {"us": 12.0, "config": {"block_n": 32, "block_k": 64, "num_stages": 3, "num_warps": 4, "split": 1}}]
    found = bench.chain_candidates(table, ranked, swiglu=False, top=3)
    assert found[0] == table and len(found) == len({tuple(sorted(c.items())) for c in found})  # no repeats
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


def test_lean_tables_fit_two_programs_per_multiprocessor_and_are_restored_after_the_engine(monkeypatch, tmp_path):
    from benchmarks.gpu import bench_fp8_rollout as fp8

    from lumenrl_backends.engines import triton_linear as tlin
    from lumenrl_quant import gemm

    lean16, lean8 = fp8.lean_tables()
    assert lean16 and lean8  # the 8B tables hold deeper pipelines than two programs per multiprocessor allow
    for key, cfg in lean16.items():
        assert cfg["num_stages"] < tlin.TUNED[key]["num_stages"]
        assert bench.smem_bytes(cfg, key[2]) <= fp8.TWO_PER_SM or cfg["num_stages"] == 2
    for key, cfg in lean8.items():
        assert cfg["num_stages"] < gemm.TRITON_ROWWISE_CONFIGS[key]["num_stages"]
        assert cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"] <= fp8.TWO_PER_SM
    monkeypatch.setenv("LUMENRL_BENCH_OUT", str(tmp_path))  # detail JSON into the test's folder
    before = (dict(tlin.TUNED), dict(gemm.TRITON_ROWWISE_CONFIGS))
    rows = fp8.main(["--model", "tiny", "--batch", "2", "--prompt", "8", "--new", "6", "--engines", "bf16,bf16+lean",
                     "--modes", "graph", "--no-exact-kl", "--out", "fp8_rollout_lean_test.json"])["rows"]
    lean = next(r for r in rows if r["engine"] == "bf16+lean")
    assert "error" not in lean and lean["lean"]["bf16"] and "decode_tok_s" in lean
    assert (dict(tlin.TUNED), dict(gemm.TRITON_ROWWISE_CONFIGS)) == before
