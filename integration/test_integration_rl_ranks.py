"""The RL trainer under torchrun: 2 gloo ranks give the same step losses as 1 process.

Data-parallel rollout: each rank generates its shard (per-row seeds), the shards are all-gathered, the FSDP2
backend trains each rank on its slice with global token counts, and only rank 0 writes run
files. The optimizer-step loss (``actor/loss``) and gradient norm must match a single process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lumenrl_backends.loggers import read_metrics

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ARGS = (
    "num_training_steps=2", "trainer.warm_start_sft_steps=20", "dataset.train_batch_size=8",
    "policy.rollout.n=4", "logger.progress_bar=false", "eval.enabled=false", "checkpointing.export_hf=false",
)


def _run(cmd_prefix: list[str], config: str, out: str) -> None:
    cmd = [*cmd_prefix, "-m", "lumenrl_backends.cli", "train", "--config", config, f"trainer.output_dir={out}", *ARGS]
    # in-process runs of this session leave a 1-rank group's RANK/MASTER_PORT/... in os.environ
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    config = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_dense_bf16.yaml")
    _run([sys.executable], config, str(tmp_path / "one"))  # builds (and caches) the 20-step warm start
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(torchrun, config, str(tmp_path / "two"))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]  # rank 0 alone wrote the log
    for a, b in zip(one, two):
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-4, abs=1e-6)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
        assert b["reward/mean"] == a["reward/mean"]
