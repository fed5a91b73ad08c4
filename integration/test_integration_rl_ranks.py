"""The RL trainer under torchrun: 2 gloo ranks give the same step losses as 1 process.

Data-parallel rollout: each rank generates its shard (per-row seeds), the shards are all-gathered, the FSDP2
backend trains each rank on its slice with global token counts, and only rank 0 writes run
files. The optimizer-step loss (``actor/loss``) and gradient norm must match a single process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lumenrl_backends.loggers import read_metrics

ARGS = (
    "num_training_steps=2", "trainer.warm_start_sft_steps=20", "dataset.train_batch_size=8",
    "policy.rollout.n=4", "logger.progress_bar=false", "eval.enabled=false", "checkpointing.export_hf=false",
)


def _run(cmd_prefix: list[str], config: str, out: str, env: dict[str, str]) -> None:
    cmd = [*cmd_prefix, "-m", "lumenrl_backends.cli", "train", "--config", config, f"trainer.output_dir={out}", *ARGS]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path, child_env):
    config = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_dense_bf16.yaml")
    _run([sys.executable], config, str(tmp_path / "one"), child_env)  # builds (and caches) the 20-step warm start
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(torchrun, config, str(tmp_path / "two"), child_env)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]  # rank 0 alone wrote the log
    for a, b in zip(one, two):
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-4, abs=1e-6)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
        assert b["reward/mean"] == a["reward/mean"]
