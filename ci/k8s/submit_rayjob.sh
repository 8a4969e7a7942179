#!/usr/bin/env bash
# Apply a rendered RayJob (verl-npu k8s render rayjob), wait until KubeRay reports it finished, keep the
# submitter's log (the launch's output) and the Ray pods' logs in OUT_DIR, and exit 0 only when the
# Ray job SUCCEEDED.
#   bash ci/k8s/submit_rayjob.sh MANIFEST NAME OUT_DIR
# Before anything is created: a server-side dry run (the cluster's own KubeRay CRD and admission), and
# every shared claim the manifest mounts must be ReadWriteMany (the launch writes on the head what
# the workers read). WAIT_S bounds the wait (default: 3 h 15 min, past the RayJob's own deadline);
# POLL_S is the interval between status reads (default 30 s).
# Deleting the objects is ci/k8s/cleanup.sh's job (the workflow runs it whatever happened here).
set -euo pipefail

MANIFEST="${1:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
NAME="${2:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
OUT="${3:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
WAIT_S="${WAIT_S:-11700}"
POLL_S="${POLL_S:-30}"
[[ -f "$MANIFEST" ]] || { echo "submit_rayjob.sh: no manifest $MANIFEST (render it with verl-npu k8s render rayjob)" >&2; exit 2; }
mkdir -p "$OUT"

kubectl apply --dry-run=server -f "$MANIFEST" >/dev/null
# every persistentVolumeClaim any pod of the manifest mounts, one per line
mapfile -t claims < <(kubectl apply --dry-run=server -f "$MANIFEST" -o jsonpath='{range ..claimName}{@}{"\n"}{end}' | sort -u)
for claim in "${claims[@]}"; do
  modes="$(kubectl get pvc "$claim" -o jsonpath='{.spec.accessModes}')" \
    || { echo "submit_rayjob.sh: the shared claim $claim does not exist in this namespace" >&2; exit 2; }
  if [[ "$modes" != *ReadWriteMany* ]]; then
    echo "submit_rayjob.sh: claim $claim has access modes $modes; every node mounts it: it must be ReadWriteMany" >&2
    exit 2
  fi
done

kubectl apply -f "$MANIFEST"
deadline=$((SECONDS + WAIT_S))
last=""
while :; do
  state="$(kubectl get "rayjob/$NAME" -o jsonpath='{.status.jobDeploymentStatus}/{.status.jobStatus}')" \
    || state="unreadable/"  # a passing API error; the deadline still bounds the wait
  [[ "$state" == "$last" ]] || echo "$(date -u +%H:%M:%S) RayJob $NAME: deployment/job status $state"
  last="$state"
  case "${state%%/*}" in Complete | Failed) break ;; esac
  if ((SECONDS >= deadline)); then
    echo "submit_rayjob.sh: RayJob $NAME not finished after $WAIT_S s" >&2
    break
  fi
  sleep "$POLL_S"
done

# The submitter Job carries the RayJob's name; its log is the launch's output (ray job logs --follow).
kubectl logs "job/$NAME" --all-containers >"$OUT/submitter.log" 2>&1 || true
for role in head worker; do
  kubectl logs -l "app.kubernetes.io/instance=$NAME,app.kubernetes.io/component=$role" --all-containers \
    --prefix --tail=-1 >"$OUT/$role.log" 2>&1 || true
done
kubectl get "rayjob/$NAME" -o yaml >"$OUT/rayjob-status.yaml" 2>&1 || true
tail -n 50 "$OUT/submitter.log"

job_status="${state#*/}"
echo "RayJob $NAME: $state"
if [[ "$job_status" != SUCCEEDED ]]; then
  kubectl get pods -l "app.kubernetes.io/instance=$NAME" -o wide || true
  exit 1
fi
