#!/usr/bin/env bash
# Fail fast, naming the fix, when this container cannot see the NPUs. verl's vLLM rollout on NPU runs
# npu-smi with no fallback, so without it a job would only fail deep inside its first rollout.
#   bash ci/nightly/check_npus.sh
# Loads CANN's environment as the image's entrypoint does: Kubernetes-mode runners and RayJob entrypoints
# run commands past the entrypoint, and npu-smi needs the driver libraries that environment points at.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=/dev/null
source "$REPO/docker/cann-env.sh"
cann_env_load "[check_npus.sh]"

FIX="give the job the NPUs: on a Kubernetes-mode runner its pod template must request them and mount npu-smi
(/usr/local/sbin/npu-smi), the driver (/usr/local/Ascend/driver) and /usr/local/dcmi; docker \`options:\` in the
workflow are ignored there (ci/README.md, runner layout)"
if ! command -v npu-smi >/dev/null; then
  printf 'check_npus.sh: npu-smi is not on PATH (%s): %s\n' "$PATH" "$FIX" >&2
  exit 1
fi
if ! info="$(npu-smi info 2>&1)"; then
  printf '%s\n' "$info" >&2
  printf 'check_npus.sh: "npu-smi info" failed (its output is above): %s\n' "$FIX" >&2
  exit 1
fi
printf '%s\n' "$info"
