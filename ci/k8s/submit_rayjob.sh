#!/usr/bin/env bash
# Submit a RayJob manifest with ${IMAGE} and ${RUN_ID} filled in, wait for it to finish and fail
# when the job fails.   IMAGE=... RUN_ID=... bash ci/k8s/submit_rayjob.sh MANIFEST
set -euo pipefail

MANIFEST="${1:?usage: submit_rayjob.sh MANIFEST}"
: "${IMAGE:?set IMAGE to the image built from this commit}" "${RUN_ID:?set RUN_ID}"
[[ "$IMAGE" != *:latest ]] || { echo "submit_rayjob.sh: refusing a floating tag ($IMAGE)" >&2; exit 2; }
NAME="verl-npu-multinode-$RUN_ID"
# shellcheck disable=SC2016  # the single quotes are envsubst's variable list, not an expansion
envsubst '${IMAGE} ${RUN_ID}' <"$MANIFEST" | kubectl apply -f -
kubectl wait --for=jsonpath='{.status.jobDeploymentStatus}'=Complete "rayjob/$NAME" --timeout=3h || true
status="$(kubectl get "rayjob/$NAME" -o jsonpath='{.status.jobStatus}')"
kubectl logs -l "job-name=$NAME" --tail=200 || true
echo "RayJob $NAME: $status"
[[ "$status" == SUCCEEDED ]]
