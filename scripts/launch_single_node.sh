#!/usr/bin/env bash
# One-node LumenRL run through a local Ray cluster: start a Ray head on this machine, run the
# driver `lumenrl train` with controller.name=ray joined to it, stop Ray on exit or failure.
#
#   scripts/launch_single_node.sh CONFIG [key=value ...]
#   e.g. scripts/launch_single_node.sh configs/recipes/ray_controller_dispatch_modes_1n8g.yaml
#
# Environment: LUMENRL_RAY_PORT (6380), LUMENRL_RAY_CPUS / LUMENRL_RAY_GPUS (default: what Ray
# detects), LUMENRL_RAY_ARGS (extra `ray start` flags), LUMENRL_TRAIN (lumenrl train).
set -euo pipefail

[[ $# -ge 1 ]] || { echo "usage: $0 CONFIG [key=value ...]" >&2; exit 2; }
CONFIG=$1; shift
[[ -f $CONFIG ]] || { echo "config file not found: $CONFIG" >&2; exit 2; }
PORT=${LUMENRL_RAY_PORT:-6380}
ADDRESS="127.0.0.1:$PORT"
EXTRA=()
[[ -n ${LUMENRL_RAY_CPUS:-} ]] && EXTRA+=(--num-cpus="$LUMENRL_RAY_CPUS")
[[ -n ${LUMENRL_RAY_GPUS:-} ]] && EXTRA+=(--num-gpus="$LUMENRL_RAY_GPUS")
read -r -a MORE <<< "${LUMENRL_RAY_ARGS:-}"

teardown() {
  local status=$?
  trap - EXIT INT TERM
  echo "[launch_single_node] stopping Ray" >&2
  ray stop --force >/dev/null 2>&1 || true
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

ray start --head --node-ip-address=127.0.0.1 --port="$PORT" --include-dashboard=false \
  --disable-usage-stats "${EXTRA[@]}" "${MORE[@]}" >&2
read -r -a TRAIN <<< "${LUMENRL_TRAIN:-lumenrl train}"
"${TRAIN[@]}" --config "$CONFIG" controller.name=ray "controller.ray.address=$ADDRESS" "$@"
