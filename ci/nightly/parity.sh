#!/usr/bin/env bash
# Nightly platform parity (issue 19): the deterministic parity job on this Ascend node, twice, each compared
# with the CUDA reference (ci/baselines/parity/reference.json, recorded on nvidia-h200) and with the other:
#   default:  what a launch gets here (MindSpeed's fused DSA operators for the model whose shapes they take,
#             torch_npu's fused RMSNorm and flash attention);
#   portable: verl-npu's portable PyTorch operators only.
# A fault both runs share is the platform's (or the engine's); one only the default run has is an operator's.
#   bash ci/nightly/parity.sh [OUT_DIR]
# Each bf16 run is judged twice: as is (its error assumed no larger than the reference's: this sees a fault
# that only bf16 has) and with its own error measured against this node's fp32 run (--precise: a less
# accurate platform passes, and the fp32 runs must agree with the reference's within the bf16 error). fp32
# has no fp64 here: its error is assumed. Exit codes: 0 every comparison passes; 1 one fails; 2 the node,
# a run or a comparison could not be made (the message says which).
set -euo pipefail

OUT="${1:-nightly-out/parity}"
NIGHTLY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$NIGHTLY_DIR/../.." && pwd)"
MODELS=(--model glm5_2 --model dense --model glm5_2_fused_shape)
mkdir -p "$OUT"

# Runner steps are exec'd past the image's entrypoint: load CANN as it would.
# shellcheck source=/dev/null
source "$REPO/docker/cann-env.sh"
cann_env_load "[parity.sh]"
if [[ -n "${VERL_NPU_EXPECT_NPUS:-}" ]]; then
  bash "$NIGHTLY_DIR/check_npus.sh" >"$OUT/npu-smi.txt" || exit 2
fi
verl-npu doctor --report "$OUT/doctor.md" || { cat "$OUT/doctor.md"; exit 2; }

for path in default portable; do
  for dtype in fp32 bf16; do
    verl-npu parity run --path "$path" --dtype "$dtype" "${MODELS[@]}" --out "$OUT/$path-$dtype.json" \
      2>&1 | tee "$OUT/$path-$dtype.log" || exit 2
  done
done

worst=0
judge() {  # NAME ARGS...: one comparison, its report and plot kept; the worst exit code wins
  local name="$1" code=0
  shift
  verl-npu parity compare "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png" || code=$?
  if ((code > 2)); then code=2; fi  # an internal error (3) is a comparison that could not be made
  if ((code > worst)); then worst=$code; fi
}
for path in default portable; do
  judge "$path-bf16-vs-cuda" "$OUT/$path-bf16.json"
  judge "$path-bf16-vs-cuda-precise" "$OUT/$path-bf16.json" --precise "$OUT/$path-fp32.json"
  judge "$path-fp32-vs-cuda" "$OUT/$path-fp32.json"
done
judge default-vs-portable-bf16 "$OUT/default-bf16.json" --against "$OUT/portable-bf16.json"
judge default-vs-portable-fp32 "$OUT/default-fp32.json" --against "$OUT/portable-fp32.json"
exit "$worst"
