#!/usr/bin/env bash
# Entrypoint of the verl-npu images: load the CANN environment, then run the command.
# torch_npu cannot load without it (libhccl.so) and fails with confusing errors when it is absent.
set -euo pipefail

ascend_root="${ASCEND_ROOT:-/usr/local/Ascend}"
set +u # CANN's scripts read unset variables
for env_script in "$ascend_root/ascend-toolkit/set_env.sh" "$ascend_root/nnal/atb/set_env.sh"; do
  if [[ -f "$env_script" ]]; then
    # shellcheck source=/dev/null
    source "$env_script"
  else
    echo "[verl-npu entrypoint] WARNING: $env_script not found; CANN is not set up in this container" >&2
  fi
done
set -u

exec "$@"
