#!/usr/bin/env bash
# Run one nightly job in the image built from this commit: the NPU check and doctor first, the job (its
# log kept), then the comparator against ci/baselines/JOB.json.
#   bash ci/nightly/run_job.sh JOB [OUT_DIR]
# VERL_NPU_EXPECT_NPUS (nightly.yml sets it per runner: 8 on A2, 16 on A3) makes a node without its NPUs
# fail here, in the NPU check and in doctor; leave it unset only where this runs on a CPU-only Ray head.
# NIGHTLY_IMAGE and NIGHTLY_COMMIT, when set, are recorded in OUT_DIR/run.env for taking baselines.
# Exit codes: the check's, doctor's or the job's on failure; the comparator's otherwise (1 = regression,
# 2 = the log or baseline cannot be compared, e.g. a baseline not yet taken).
set -euo pipefail

JOB="${1:?usage: run_job.sh JOB [OUT_DIR]}"
OUT="${2:-nightly-out/$JOB}"
NIGHTLY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$NIGHTLY_DIR/../.." && pwd)"
SCRIPT="$NIGHTLY_DIR/jobs/$JOB.sh"
BASELINE="$REPO/ci/baselines/$JOB.json"
[[ -f "$SCRIPT" ]] || { echo "run_job.sh: no job $JOB ($SCRIPT)" >&2; exit 2; }
[[ -f "$BASELINE" ]] || { echo "run_job.sh: no baseline $BASELINE" >&2; exit 2; }
mkdir -p "$OUT"
printf 'JOB=%s\nIMAGE=%s\nCOMMIT=%s\n' "$JOB" "${NIGHTLY_IMAGE:-unknown}" "${NIGHTLY_COMMIT:-unknown}" >"$OUT/run.env"

# Runner steps and RayJob entrypoints are exec'd past the image's entrypoint: load CANN as it would.
# shellcheck source=/dev/null
source "$REPO/docker/cann-env.sh"
cann_env_load "[run_job.sh]"
# A RayJob rendered by `verl-npu k8s render` points VERL_NPU_ENV_FILE at its ConfigMap copy of nightly.env
# (plus the cluster's values); the driver forwards that same file to the workers, as ray_start.sh used it.
ENV_FILE="${VERL_NPU_ENV_FILE:-$NIGHTLY_DIR/nightly.env}"
[[ -f "$ENV_FILE" ]] || { echo "run_job.sh: VERL_NPU_ENV_FILE=$ENV_FILE does not exist" >&2; exit 2; }
set -a
# shellcheck source=/dev/null
source "$ENV_FILE"
set +a
export VERL_NPU_ENV_FILE="$ENV_FILE"

if [[ -n "${VERL_NPU_EXPECT_NPUS:-}" ]]; then
  bash "$NIGHTLY_DIR/check_npus.sh" >"$OUT/npu-smi.txt"
fi
verl-npu doctor --report "$OUT/doctor.md" || { cat "$OUT/doctor.md"; exit 1; }

LOG="$OUT/train.log"
: >"$LOG"
if [[ "$JOB" == ckpt_resume_offload ]]; then
  rm -rf "$WORK_ROOT/ckpt_resume_offload/checkpoints"
  STEPS=8 bash "$SCRIPT" 2>&1 | tee -a "$LOG"   # saves at step 8
  STEPS=15 bash "$SCRIPT" 2>&1 | tee -a "$LOG"  # resumes from step 8 in a new process
else
  bash "$SCRIPT" 2>&1 | tee -a "$LOG"
fi

verl-npu ci compare "$LOG" "$BASELINE" --json "$OUT/compare.json"
