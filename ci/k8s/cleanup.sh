#!/usr/bin/env bash
# Delete everything one rendered run created, found by its label (so it works when rendering or applying
# failed half-way, and after a cancelled run): the RayJob (its RayCluster and submitter Job go with it),
# the ConfigMap and the results pod; the NPUs are free again once the Ray pods are gone.
# SCRATCH_DIR, if given, is removed from the shared storage first (the run's generated model and data;
# its results stay beside it).
#   bash ci/k8s/cleanup.sh NAME [SCRATCH_DIR]
set -euo pipefail

NAME="${1:?usage: cleanup.sh NAME [SCRATCH_DIR]}"
SCRATCH="${2:-}"
SELECTOR="app.kubernetes.io/instance=$NAME"
status=0

if [[ -n "$SCRATCH" ]]; then
  if kubectl get "pod/$NAME-results" >/dev/null 2>&1 && kubectl exec "$NAME-results" -- rm -rf "$SCRATCH"; then
    echo "cleanup.sh: removed $SCRATCH"
  else
    echo "cleanup.sh: could not remove $SCRATCH (no running results pod); it stays on the shared storage" >&2
  fi
fi
kubectl delete rayjob,configmap,pod -l "$SELECTOR" --ignore-not-found --wait=false || status=1
# A RayCluster whose RayJob is gone is garbage-collected by Kubernetes; delete it by name as well so a
# cluster never outlives this step holding its NPUs.
kubectl delete raycluster -l "ray.io/originated-from-cr-name=$NAME" --ignore-not-found --wait=false || status=1
kubectl get pods -l "$SELECTOR" -o name 2>/dev/null || true
exit "$status"
