#!/usr/bin/env bash
# Copy a run's results off the shared storage through its results pod (verl-npu k8s render --results-pod:
# <NAME>-results mounts the same claims as the Ray pods), whether or not the Ray cluster still exists.
#   bash ci/k8s/copy_results.sh NAME SRC_DIR DEST_DIR
set -euo pipefail

NAME="${1:?usage: copy_results.sh NAME SRC_DIR DEST_DIR}"
SRC="${2:?usage: copy_results.sh NAME SRC_DIR DEST_DIR}"
DEST="${3:?usage: copy_results.sh NAME SRC_DIR DEST_DIR}"
POD="$NAME-results"

if ! kubectl wait --for=condition=Ready "pod/$POD" --timeout=10m; then
  kubectl describe "pod/$POD" >&2 || true
  echo "copy_results.sh: the results pod $POD is not running: nothing copied" >&2
  exit 1
fi
if ! kubectl exec "$POD" -- test -d "$SRC"; then
  echo "copy_results.sh: $SRC does not exist on the shared storage (the launch wrote no results)" >&2
  exit 1
fi
mkdir -p "$(dirname "$DEST")"
kubectl cp "$POD:$SRC" "$DEST"
find "$DEST" -type f -printf '%P\n' | sort
