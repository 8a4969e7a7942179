#!/usr/bin/env bash
# Run one nightly job in the image built from this commit: doctor first, the job (its log kept),
# then the comparator against ci/baselines/JOB.json.
#   bash ci/nightly/run_job.sh JOB [OUT_DIR]
# Exit codes: the doctor's or the job's on failure; the comparator's otherwise (1 = regression,
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
set -a
# shellcheck source=/dev/null
source "$NIGHTLY_DIR/nightly.env"
set +a
export VERL_NPU_ENV_FILE="$NIGHTLY_DIR/nightly.env"

verl-npu doctor --json >"$OUT/doctor.json" || { cat "$OUT/doctor.json"; exit 1; }

LOG="$OUT/train.log"
: >"$LOG"
if [[ "$JOB" == ckpt_resume_offload ]]; then
  rm -rf "$CKPT_ROOT/ckpt_resume_offload"
  STEPS=8 bash "$SCRIPT" 2>&1 | tee -a "$LOG"   # saves at step 8
  STEPS=15 bash "$SCRIPT" 2>&1 | tee -a "$LOG"  # resumes from step 8 in a new process
else
  bash "$SCRIPT" 2>&1 | tee -a "$LOG"
fi

verl-npu ci compare "$LOG" "$BASELINE" --json "$OUT/compare.json"
