"""An option a benchmark would ignore is refused, before any work, with one line naming the flag and the value;
``--smoke`` fills in only the options the command line left out."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _bench_out(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMENRL_BENCH_OUT", str(tmp_path))


def _refused(main, argv: list[str], capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    text = capsys.readouterr().err + str(info.value.code if not isinstance(info.value.code, int) else "")
    assert info.value.code != 0 and all(w in text for w in words), text
    return text


def test_only_names_entries_of_the_chosen_suite():
    from benchmarks.suite import entries

    with pytest.raises(SystemExit, match=r"--only \['decode'\]: not entries of suite 'moe'.*r3_mismatch.*'gpu'"):
        entries("moe", ("decode",))
    with pytest.raises(SystemExit, match="bogus"):
        entries("gpu", ("bogus",))
    assert [e.name for e in entries("moe", ("r3_mismatch",))] == ["r3_mismatch"]


@pytest.mark.parametrize(("module", "argv", "words"), [
    ("benchmarks.gpu.bench_decode", ["--modes", "graph,fulll"], ("--modes", "fulll", "eager, graph, full")),
    ("benchmarks.gpu.bench_decode", ["--hf", "statc"], ("--hf", "statc", "dynamic, static")),
    ("benchmarks.gpu.bench_train", ["--smoke", "--profile", "1.7b/bf16+nope"], ("--profile", "not among --variants")),
    ("benchmarks.gpu.bench_train", ["--smoke", "--variants", "1.7b/bf16+single", "--profile", "1.7b/bf16+single"],
     ("--profile", "needs CUDA")),
    ("benchmarks.quant.bench_fp8_training", ["--linear", "--steps", "3"], ("--steps=3", "--linear")),
    ("benchmarks.quant.bench_fp8_training", ["--linear", "--variants", "bf16", "--profile", "bf16"],
     ("--variants='bf16'", "--profile='bf16'")),
    ("benchmarks.quant.bench_fp8_training", ["--variants", "bf16", "--profile", "fp8"], ("--profile", "fp8")),
    ("benchmarks.gpu.bench_attention", ["--space", "fp8wide"], ("--space", "fp8wide", "--tune")),
    ("benchmarks.quant.bench_decode_gemm", ["--space", "wide"], ("--space", "wide", "--tune")),
    ("benchmarks.gpu.bench_decode_linear", ["--splits", "1,2"], ("--splits", "--tune")),
    ("benchmarks.gpu.bench_decode_linear", ["--tma", "1"], ("--tma", "--tune")),
    ("benchmarks.gpu.bench_decode_linear", ["--tune-chain", "3"], ("--tune-chain", "--tune")),
    ("benchmarks.quant.bench_quantize", ["--kernels", "mx_e4m3"], ("--kernels", "--tune")),
    ("benchmarks.quant.bench_quantize", ["--tune", "--kernels", "nope"], ("--kernels", "nope")),
    ("benchmarks.quant.bench_fused_mlp", ["--tune", "--m", "16,64"], ("--m", "16,64", "--tune")),
    ("benchmarks.gpu.bench_sampler", ["--modes", "plain,top"], ("--modes", "top")),
    ("benchmarks.gpu.bench_logprobs", ["--smoke", "--shapes", "train"], ("--shapes", "--smoke")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_an_ignored_option_is_refused(module, argv, words, capsys):
    import importlib

    _refused(importlib.import_module(module).main, argv, capsys, *words)


def test_tuning_without_cuda_is_refused_with_the_reason(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    from benchmarks.gpu import bench_decode_linear
    from benchmarks.quant import bench_quantize

    _refused(bench_decode_linear.main, ["--tune"], capsys, "--tune", "needs CUDA")
    _refused(bench_quantize.main, ["--tune"], capsys, "--tune", "needs CUDA")


def test_smoke_fills_in_only_what_the_command_line_left_out():
    from benchmarks.gpu import bench_sampler

    rows = bench_sampler.main(["--smoke", "--batches", "3", "--vocab", "500", "--modes", "greedy"])["rows"]
    assert {r["batch"] for r in rows} == {3} and {r["mode"] for r in rows} == {"greedy"}
    assert bench_sampler.main(["--smoke", "--modes", "greedy"])["vocab"] == 3000
