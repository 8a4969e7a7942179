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
# Which npu-smi answered goes to stderr (the job log): stdout is the capture run_job.sh and parity.sh keep.
if ! npu_smi="$(command -v npu-smi)"; then
  printf 'check_npus.sh: found no npu-smi: npu-smi is not on PATH (%s): %s\n' "$PATH" "$FIX" >&2
  exit 1
fi
resolved="$(readlink -f -- "$npu_smi" 2>/dev/null || true)"
if [[ -n "$resolved" && "$resolved" != "$npu_smi" ]]; then
  printf 'check_npus.sh: using npu-smi at %s (-> %s)\n' "$npu_smi" "$resolved" >&2
else
  printf 'check_npus.sh: using npu-smi at %s\n' "$npu_smi" >&2
fi
if ! info="$("$npu_smi" info 2>&1)"; then
  printf '%s\n' "$info" >&2
  printf 'check_npus.sh: "npu-smi info" failed (%s; its output is above): %s\n' "$npu_smi" "$FIX" >&2
  exit 1
fi
printf '%s\n' "$info"
