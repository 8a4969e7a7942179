#!/usr/bin/env bash
# Start Ray on one node of the GLM-5.2 cluster, with the environment of glm5_2.env.
#
#   on the head node:    bash examples/glm5_2/ray_start.sh head [NODE_IP]
#   on every worker:     bash examples/glm5_2/ray_start.sh worker HEAD_IP
#
# Before `ray start`, each node finds the interface that routes to the head (on the head: the one
# holding NODE_IP, by default the default route's), exports HCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME
# and TP_SOCKET_IFNAME for it unless the env file sets them, and checks its network (those
# interfaces up, HCCL's host ports free and clear of Ray's, each NPU's device NIC):
# python3 -m verl_npu.cluster.network. A failure stops the node here, the findings printed.
# Ray then starts with --node-ip-address of that interface, so the raylet and its workers use it.
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

ROLE="${1:-}"
case "$ROLE" in
  head) HEAD_IP="${2:-auto}" ;;
  worker) HEAD_IP="${2:?usage: ray_start.sh worker HEAD_IP}" ;;
  *)
    echo "usage: ray_start.sh head [NODE_IP] | worker HEAD_IP" >&2
    exit 2
    ;;
esac

# NAME=VALUE lines: NODE_IP, and each *_SOCKET_IFNAME the env file left unset
node_env="$(python3 -m verl_npu.cluster.network node-env --head "$HEAD_IP")" || exit 2
while IFS='=' read -r name value; do
  [[ -z "$name" ]] || export "$name=$value"
done <<< "$node_env"
if [[ "$ROLE" == head ]]; then HEAD_IP="$NODE_IP"; fi
echo "ray_start.sh: $ROLE at $NODE_IP, HCCL_SOCKET_IFNAME=${HCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"

if ! python3 -m verl_npu.cluster.network check --role "$ROLE" --head "$HEAD_IP"; then
  echo "ray_start.sh: the network check failed on $(hostname) ($NODE_IP); fix the failures above, then rerun" >&2
  exit 1
fi

ray_args_text="$(python3 -m verl_npu.cluster.network ray-args --role "$ROLE")" || exit 2
mapfile -t ray_args <<< "$ray_args_text"

case "$ROLE" in
  head)
    ray start --head --dashboard-host=0.0.0.0 "${ray_args[@]}"
    python3 -m verl_npu.cluster.smoke --expect $((NNODES * NPUS_PER_NODE)) --backend hccl \
      --wait-timeout "${SMOKE_WAIT_S:-1800}"
    ;;
  worker)
    ray start --address="$HEAD_IP:${RAY_PORT:-6379}" "${ray_args[@]}"
    ;;
esac
