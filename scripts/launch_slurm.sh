#!/usr/bin/env bash
# Multi-node LumenRL run on a Slurm allocation through Ray.
#
#   sbatch --nodes=4 --gpus-per-node=8 --wrap "scripts/launch_slurm.sh 4 CONFIG [key=value ...]"
#   (or inside `salloc --nodes=4 ...`)
#
# Starts the Ray head on the allocation's first node and one Ray worker on every other node
# (srun), waits until NODES nodes are alive (`ray status`), runs the driver `lumenrl train` on
# this node with controller.name=ray joined to that cluster, and tears the cluster down on exit,
# failure or signal (trap). The driver's exit status is the script's.
# Environment: LUMENRL_RAY_PORT (6379), LUMENRL_WAIT_S (300: how long to wait for the nodes),
# LUMENRL_HEAD_ADDR (default: the first host of SLURM_JOB_NODELIST), LUMENRL_TRAIN (lumenrl train).
set -euo pipefail

usage() { echo "usage: $0 NODES CONFIG [key=value ...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
NODES=$1; CONFIG=$2; shift 2
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "NODES must be a positive integer, got '$NODES'" >&2; exit 2; }
[[ -f $CONFIG ]] || { echo "config file not found: $CONFIG" >&2; exit 2; }
[[ -n ${SLURM_JOB_NODELIST:-} ]] || { echo "not inside a Slurm allocation (SLURM_JOB_NODELIST unset)" >&2; exit 2; }

PORT=${LUMENRL_RAY_PORT:-6379}
WAIT_S=${LUMENRL_WAIT_S:-300}
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#HOSTS[@]} >= NODES )) || { echo "allocation has ${#HOSTS[@]} nodes, NODES=$NODES" >&2; exit 2; }
HEAD_HOST=${HOSTS[0]}
HEAD_ADDR=${LUMENRL_HEAD_ADDR:-$HEAD_HOST}
ADDRESS="$HEAD_ADDR:$PORT"
PIDS=()

teardown() {
  local status=$?
  trap - EXIT INT TERM
  echo "[launch_slurm] tearing down the Ray cluster" >&2
  srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 ray stop --force >/dev/null 2>&1 || true
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

echo "[launch_slurm] head $HEAD_HOST ($ADDRESS), $NODES nodes" >&2
srun --nodes=1 --ntasks=1 -w "$HEAD_HOST" ray start --head --node-ip-address="$HEAD_ADDR" --port="$PORT" \
  --disable-usage-stats --block &
PIDS+=($!)
if (( NODES > 1 )); then
  srun --nodes=$((NODES - 1)) --ntasks=$((NODES - 1)) --ntasks-per-node=1 --exclude="$HEAD_HOST" \
    ray start --address="$ADDRESS" --disable-usage-stats --block &
  PIDS+=($!)
fi

deadline=$((SECONDS + WAIT_S)); alive=0
while (( SECONDS < deadline )); do
  alive=$(ray status --address="$ADDRESS" 2>/dev/null | grep -c " node_" || true)
  (( alive >= NODES )) && break
  sleep 2
done
(( alive >= NODES )) || { echo "[launch_slurm] only $alive of $NODES Ray nodes came up in ${WAIT_S}s" >&2; exit 1; }
echo "[launch_slurm] $alive nodes alive; starting the driver" >&2

read -r -a TRAIN <<< "${LUMENRL_TRAIN:-lumenrl train}"
"${TRAIN[@]}" --config "$CONFIG" controller.name=ray "controller.ray.address=$ADDRESS" "cluster.num_nodes=$NODES" "$@"
