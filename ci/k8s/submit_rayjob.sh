#!/usr/bin/env bash
# Apply a rendered RayJob (verl-npu k8s render rayjob), wait until KubeRay reports it finished, keep the
# submitter's log (the launch's output) and the Ray pods' logs in OUT_DIR, and exit 0 only when the
# Ray job SUCCEEDED.
#   bash ci/k8s/submit_rayjob.sh MANIFEST NAME OUT_DIR
# Before anything is created: a server-side dry run (the cluster's own KubeRay CRD and admission), and
# every shared claim the manifest mounts must be ReadWriteMany (the launch writes on the head what
# the workers read). WAIT_S bounds the wait (default: 3 h 15 min, past the RayJob's own deadline);
# POLL_S is the interval between status reads (default 30 s).
# The wait ends at every deployment status after which KubeRay changes nothing (docs/kuberay_rayjob.md):
# Complete, Failed and ValidationFailed, and when the RayJob is gone; the last line names the status, the
# job status and KubeRay's reason and message.
# Exit: 0 the Ray job SUCCEEDED; 1 it ended otherwise, the RayJob vanished or the wait ran out; 2 refused
# before anything ran (no manifest, a claim that is not ReadWriteMany, KubeRay's ValidationFailed, no kubectl).
# Deleting the objects is ci/k8s/cleanup.sh's job (the workflow runs it whatever happened here).
set -euo pipefail

MANIFEST="${1:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
NAME="${2:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
OUT="${3:?usage: submit_rayjob.sh MANIFEST NAME OUT_DIR}"
WAIT_S="${WAIT_S:-11700}"
POLL_S="${POLL_S:-30}"
# checked before anything is applied; digits spelled out: [0-9] may match other scripts' digits in a UTF-8 locale
[[ "$WAIT_S" =~ ^[123456789][0123456789]{0,6}$ ]] || {
  echo "submit_rayjob.sh: WAIT_S='$WAIT_S': expected a whole number of seconds from 1 to 9999999 (ASCII digits)" >&2
  exit 2
}
[[ "$POLL_S" =~ ^[0123456789]{1,4}(\.[0123456789]{1,3})?$ ]] || {
  echo "submit_rayjob.sh: POLL_S='$POLL_S': expected seconds between polls, such as 30 or 0.5 (ASCII digits)" >&2
  exit 2
}
[[ -f "$MANIFEST" ]] || { echo "submit_rayjob.sh: no manifest $MANIFEST (render it with verl-npu k8s render rayjob)" >&2; exit 2; }
for tool in kubectl python3; do
  command -v "$tool" >/dev/null || {
    echo "submit_rayjob.sh: $tool is not on PATH: the runner needs kubectl with access to the cluster, and python3 (ci/README.md)" >&2
    exit 2
  }
done
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

# One line from the RayJob's JSON on stdin: deployment status, job status, reason, message, separated by the
# ASCII unit separator (not whitespace, so empty fields stay fields), whitespace in each folded: Ray's failure
# message carries the log's last lines.
STATUS_FIELDS='import json, sys
status = json.load(sys.stdin).get("status") or {}
keys = ("jobDeploymentStatus", "jobStatus", "reason", "message")
print("\x1f".join(" ".join(str(status.get(key) or "").split()) for key in keys))'

deadline=$((SECONDS + WAIT_S))
errors="$(mktemp)"
trap 'rm -f "$errors"' EXIT
last="" deployment="" job_status="" reason="" message="" ended=""
while :; do
  if doc="$(kubectl get "rayjob/$NAME" -o json 2>"$errors")" &&
    fields="$(python3 -c "$STATUS_FIELDS" <<<"$doc" 2>>"$errors")"; then
    IFS=$'\x1f' read -r deployment job_status reason message <<<"$fields" || true
    state="${deployment:-New}/${job_status:-none}"
  elif grep -q '(NotFound)' "$errors"; then
    ended=gone
    break
  else
    state="unreadable: $(tail -n 1 "$errors")"  # a passing API error; the deadline still bounds the wait
  fi
  [[ "$state" == "$last" ]] || echo "$(date -u +%H:%M:%S) RayJob $NAME: deployment/job status $state${reason:+ ($reason)}"
  last="$state"
  case "$deployment" in Complete | Failed | ValidationFailed) ended=status && break ;; esac
  if ((SECONDS >= deadline)); then
    ended=timeout
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

verdict="RayJob $NAME: deployment status ${deployment:-none}, job status ${job_status:-none}"
[[ -z "$reason$message" ]] || verdict+=", reason ${reason:-none}: ${message:-no message}"
case "$ended" in
  gone) echo "submit_rayjob.sh: RayJob $NAME no longer exists (deleted before it finished; last seen: ${last:-never})" >&2 ;;
  timeout) echo "submit_rayjob.sh: RayJob $NAME not finished after $WAIT_S s; $verdict" >&2 ;;
  *) echo "$verdict" ;;
esac
if [[ "$ended" == status && "$deployment" == Complete && "$job_status" == SUCCEEDED ]]; then
  exit 0
fi
kubectl get pods -l "app.kubernetes.io/instance=$NAME" -o wide || true
if [[ "$deployment" == ValidationFailed ]]; then
  echo "submit_rayjob.sh: KubeRay refused the RayJob's spec: nothing ran. Fix the render (verl-npu k8s render) for: $message" >&2
  exit 2
fi
exit 1
