"""The launchers' argument handling and tear-down, with stub ``srun``/``scontrol``/``ray`` on PATH.

The stubs run locally and log their arguments: ``srun`` runs its command once per task (dropping its own flags),
``ray status`` reports as many nodes as ``ray start`` calls so far, and the driver is a stub
command that records its arguments and exits with a chosen status.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "grpo_dense_bf16.yaml"

STUBS = {
    "srun": """#!/usr/bin/env bash
echo "srun $*" >> "$LOG"
tasks=1
while [[ $# -gt 0 && $1 == -* ]]; do
  [[ $1 == --ntasks=* ]] && tasks=${1#--ntasks=}
  if [[ $1 == -w ]]; then shift; fi   # -w HOST takes a value; every other srun flag is --key=value
  shift
done
for _ in $(seq 1 "$tasks"); do "$@"; done   # one task per node, run here
""",
    "scontrol": """#!/usr/bin/env bash
printf 'node-a\\nnode-b\\nnode-c\\n'
""",
    "ray": """#!/usr/bin/env bash
echo "ray $*" >> "$LOG"
case $1 in
  start) echo x >> "$STATE/started" ;;
  status) n=$(cat "$STATE/started" 2>/dev/null | wc -l); for i in $(seq 1 "$n"); do echo " 1 node_$i"; done ;;
esac
""",
    "driver": """#!/usr/bin/env bash
echo "driver $*" >> "$LOG"
exit "${DRIVER_STATUS:-0}"
""",
}


@pytest.fixture()
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
           "STATE": str(tmp_path), "LUMENRL_TRAIN": str(bin_dir / "driver"), "LUMENRL_WAIT_S": "10",
           "SLURM_JOB_NODELIST": "node-[a-c]"}
    return env, tmp_path / "log"


def run(script: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_slurm_launcher_starts_head_and_workers_runs_the_driver_and_tears_down(stubs):
    env, log = stubs
    result = run("launch_slurm.sh", ["2", str(CONFIG), "num_training_steps=3"], env)
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    assert any(line.startswith("srun --nodes=1 --ntasks=1 -w node-a ray start --head") for line in lines)
    assert any("--exclude=node-a ray start --address=node-a:6379" in line for line in lines)
    driver = [line for line in lines if line.startswith("driver")]
    assert driver == [f"driver --config {CONFIG} controller.name=ray controller.ray.address=node-a:6379 "
                      "cluster.num_nodes=2 num_training_steps=3"]
    assert lines[-1].startswith("ray stop") or any("ray stop --force" in line for line in lines[lines.index(driver[0]):])


def test_slurm_launcher_tears_down_and_returns_the_driver_failure(stubs):
    env, log = stubs
    result = run("launch_slurm.sh", ["3", str(CONFIG)], {**env, "DRIVER_STATUS": "7"})
    assert result.returncode == 7
    text = log.read_text()
    assert "cluster.num_nodes=3" in text and text.rstrip().splitlines()[-1].endswith("ray stop --force")


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "usage"), (["two", str(CONFIG)], "positive integer"), (["2", "missing.yaml"], "config file not found"),
     (["5", str(CONFIG)], "allocation has 3 nodes")],
)
def test_slurm_launcher_refuses_bad_arguments(stubs, args, message):
    env, log = stubs
    result = run("launch_slurm.sh", args, env)
    assert result.returncode == 2 and message in result.stderr
    assert not log.exists()  # nothing was started


def test_single_node_launcher_runs_the_driver_and_stops_ray(stubs):
    env, log = stubs
    result = run("launch_single_node.sh", [str(CONFIG), "seed=3"], {**env, "DRIVER_STATUS": "1"})
    assert result.returncode == 1
    lines = log.read_text().splitlines()
    assert lines[0].startswith("ray start --head --node-ip-address=127.0.0.1 --port=6380")
    assert lines[1] == f"driver --config {CONFIG} controller.name=ray controller.ray.address=127.0.0.1:6380 seed=3"
    assert lines[2] == "ray stop --force"


def test_ray_recipe_loads_with_the_original_keys():
    from lumenrl_core.config import load_config

    cfg = load_config(REPO / "configs" / "recipes" / "ray_controller_dispatch_modes_1n8g.yaml", machine=False)  # a GPU preset
    assert cfg.controller.name == "ray"  # controller.ray.enabled: true
    assert cfg.controller.ray.num_workers == 8 and cfg.controller.ray.roles["rollout"]["dispatch_mode"] == "dp_compute_proto"
    legacy = load_config(REPO / "configs" / "recipes" / "ray_controller_dispatch_modes_1n8g.yaml",
                         ["controller.ray.rollout.dispatch_mode=rank_zero"], machine=False)  # original per-role layout
    assert legacy.controller.ray.roles["rollout"]["dispatch_mode"] == "rank_zero"
