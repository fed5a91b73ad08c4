"""The RL trainer under torchrun: 2 gloo ranks give the same step losses as 1 process.

Data-parallel rollout: each rank generates its shard (per-row seeds), the shards are all-gathered, the FSDP2
backend trains each rank on its slice with global token counts, and only rank 0 writes run
files. The optimizer-step loss (``actor/loss``) and gradient norm must match a single process; so must
they with ``policy.parallel.tp=2`` (both ranks one tensor-parallel group: actor and reference sharded,
weights synced to each rank's engine from the TP DTensors).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from lumenrl_backends.loggers import read_metrics
from lumenrl_backends.models import build_tiny_model

ARGS = (
    "num_training_steps=2", "trainer.warm_start_sft_steps=20", "dataset.train_batch_size=8",
    "policy.rollout.n=4", "logger.progress_bar=false", "eval.enabled=false", "checkpointing.export_hf=false",
)


def _run(cmd_prefix: list[str], config: str, out: str, env: dict[str, str], args: tuple[str, ...] = ARGS) -> None:
    cmd = [*cmd_prefix, "-m", "lumenrl_backends.cli", "train", "--config", config, f"trainer.output_dir={out}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_data_and_tensor_parallel_match_one_process(tmp_path, child_env):
    """GRPO on a tiny Qwen3 whose vocabulary (64) tp divides (no warm start: that is for the built-in demo
    model; step 2 has reward spread, so a real gradient), one process against 2 torchrun ranks twice: data
    parallel (dp=2) and tensor parallel (tp=2). One single-process baseline serves both."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_dense_bf16.yaml")
    model = build_tiny_model("qwen3", tmp_path / "model", vocab_size=64, initializer_range=0.2)
    args = (*ARGS[:1], "trainer.warm_start_sft_steps=0", *ARGS[2:], f"policy.model_name={model}")
    _run([sys.executable], config, str(tmp_path / "one"), child_env, args)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(torchrun, config, str(tmp_path / "dp2"), child_env, args)
    _run(torchrun, config, str(tmp_path / "tp2"), child_env, (*args, "policy.parallel.tp=2"))
    one = read_metrics(tmp_path / "one")
    assert one[-1]["actor/grad_norm"] > 0
    for name in ("dp2", "tp2"):
        two = read_metrics(tmp_path / name)
        assert [r["step"] for r in two] == [1, 2], name  # rank 0 alone wrote the log
        assert all(math.isfinite(v) for r in two for v in r.values() if isinstance(v, float)), name
        for a, b in zip(one, two):
            assert b["reward/mean"] == a["reward/mean"], name
            assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-4, abs=1e-6), name
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4, abs=1e-6), name
            if name == "tp2":  # dp ranks average their own entropy means (a diagnostic, like the other step metrics)
                assert b["actor/entropy"] == pytest.approx(a["actor/entropy"], rel=1e-4), name
