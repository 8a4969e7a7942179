#!/usr/bin/env bash
# Preflight every launch the repository ships: the examples and the nightly jobs. Exit non-zero if
# any says no-go; each report's JSON goes to $PREFLIGHT_OUT (default preflight-reports/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

VERL_NPU="${VERL_NPU:-.venv/bin/verl-npu}"
OUT="${PREFLIGHT_OUT:-preflight-reports}"
mkdir -p "$OUT"
failed=0
for launch in examples/*/run_*.sh ci/nightly/jobs/*.sh; do
  name="$(basename "$(dirname "$launch")")_$(basename "$launch" .sh)"
  # a launch may name its chip and model config: "# preflight: --chip a2 --model-config DIR"
  read -r -a options <<<"$(sed -n 's/^# preflight: //p' "$launch")"
  echo "=== preflight $launch ${options[*]}"
  if ! "$VERL_NPU" preflight "${options[@]}" "$launch" --json "$OUT/$name.json"; then
    failed=1
  fi
done
exit "$failed"
