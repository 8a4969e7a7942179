#!/usr/bin/env bash
# Nightly platform parity (issues 19, 30): the deterministic parity job on this Ascend node, judged block by block
# against the CUDA reference (ci/baselines/parity/reference.json, recorded on nvidia-h200; docs/parity.md):
#   default:  what a launch gets here (MindSpeed's fused DSA operators for the model whose shapes they take,
#             torch_npu's fused RMSNorm and flash attention);
#   portable: verl-npu's portable PyTorch operators only.
# Per path: the fp32 run feeds every block the reference's fp32 inputs (--replay-from) and is judged against the
# reference's outputs with the reference's measured fp32 error (HF32 off, deterministic operators); the bf16 run feeds
# every block this node's fp32 inputs and is judged against that fp32 run with the reference's measured bf16 error
# (--precise; its end-to-end numbers against the CUDA bf16 run are a summary). A fault is named at the first block
# out of tolerance. glm5_2_fused_shape records no block tensors: its bf16 run (on the default path, MindSpeed's fused
# DSA operators, which compute in bf16 only) is judged end to end against the node's fp32 run, its indexer by every
# query row's top-k (docs/parity.md). The two paths are also compared end to end with each other: a fault only the default run has is
# an operator's.
#   bash ci/nightly/parity.sh [OUT_DIR]
# Exit codes: 0 every comparison passes; 1 one fails; 2 the node, a run or a comparison could not be made (the
# message says which).
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

REFERENCE="$REPO/ci/baselines/parity/reference.json"
for path in default portable; do
  verl-npu parity run --path "$path" --dtype fp32 "${MODELS[@]}" --replay-from "$REFERENCE" \
    --out "$OUT/$path-fp32.json" 2>&1 | tee "$OUT/$path-fp32.log" || exit 2
  verl-npu parity run --path "$path" --dtype bf16 "${MODELS[@]}" --replay-from "$OUT/$path-fp32.json" \
    --out "$OUT/$path-bf16.json" 2>&1 | tee "$OUT/$path-bf16.log" || exit 2
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
  judge "$path-fp32-vs-cuda" "$OUT/$path-fp32.json"
  judge "$path-bf16-vs-own-fp32" "$OUT/$path-bf16.json" --precise "$OUT/$path-fp32.json"
done
judge default-vs-portable-bf16 "$OUT/default-bf16.json" --against "$OUT/portable-bf16.json"
judge default-vs-portable-fp32 "$OUT/default-fp32.json" --against "$OUT/portable-fp32.json"
exit "$worst"
