#!/usr/bin/env bash
# Start Ray on one node of the GLM-5.2 cluster, with the environment of glm5_2.env.
#
#   on the head node:    bash examples/glm5_2/ray_start.sh head
#   on every worker:     bash examples/glm5_2/ray_start.sh worker HEAD_IP
#
# The head then waits until NNODES x NPUS_PER_NODE NPUs have registered with Ray and runs an HCCL
# all-reduce over all of them (python -m verl_npu.cluster.smoke); it exits non-zero, naming the
# missing or failing nodes, if either fails. Launch training only after it succeeded.
# ENV_FILE overrides the env file; SMOKE_WAIT_S the registration timeout (default 1800 s).
set -euo pipefail

EXAMPLE_DIR="${BASH_SOURCE[0]%/*}"
ENV_FILE="${ENV_FILE:-$EXAMPLE_DIR/glm5_2.env}"
[[ -f "$ENV_FILE" ]] || { echo "ray_start.sh: env file $ENV_FILE not found" >&2; exit 2; }
set -a
# shellcheck source=/dev/null
source "$ENV_FILE"
set +a
VERL_NPU_ENV_FILE="$(cd "$(dirname "$ENV_FILE")" && pwd)/$(basename "$ENV_FILE")"
export VERL_NPU_ENV_FILE

JEMALLOC="/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2"
if [[ -f "$JEMALLOC" ]]; then export LD_PRELOAD="$JEMALLOC${LD_PRELOAD:+:$LD_PRELOAD}"; fi

case "${1:-}" in
  head)
    ray start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0
    python3 -m verl_npu.cluster.smoke --expect $((NNODES * NPUS_PER_NODE)) --backend hccl \
      --wait-timeout "${SMOKE_WAIT_S:-1800}"
    ;;
  worker)
    HEAD_IP="${2:?usage: ray_start.sh worker HEAD_IP}"
    ray start --address="$HEAD_IP:$RAY_PORT"
    ;;
  *)
    echo "usage: ray_start.sh head | worker HEAD_IP" >&2
    exit 2
    ;;
esac
