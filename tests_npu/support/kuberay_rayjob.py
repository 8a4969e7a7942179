"""RayJob objects as `kubectl get rayjob/NAME -o json` shows them while KubeRay v1.7 runs one, for the kubectl
stand-in (support/kubectl_standin.py) that ci/k8s/submit_rayjob.sh is tested against.

The deployment statuses, job statuses, reasons and messages are the ones KubeRay v1.7.0's RayJob controller and
Ray's job supervisor write (docs/kuberay_rayjob.md lists them); the rest of each object is the shape the API server
returns for a RayJob rendered by `verl-npu k8s render rayjob` (K8sJobMode, backoffLimit 0, a deadline).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

START = "2026-12-01T19:00:05Z"
START_GO = "2026-12-01 19:00:05 +0000 UTC"  # how the controller's messages print a metav1.Time
END = "2026-12-01T20:41:37Z"
DEADLINE_S = 11100
RAY_FAILED_LOG = (
    "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
    "(TaskRunner pid=5312) step:3 - actor/entropy:0.612 - critic/rewards/mean:0.031\n"
    "RuntimeError: HCCL function error: HcclAllReduce, error code is 7\n"
)

# deployment status, job status, reason, message; and what else the controller has set by then
STATES: dict[str, dict] = {
    "New": {},  # just created: the operator has not written a status yet
    "Initializing": {"jobDeploymentStatus": "Initializing"},
    "Running": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "message": "Job is currently running."},
    "Suspended": {"jobDeploymentStatus": "Suspended"},  # held by a queue (spec.suspend): not an end
    "Complete/SUCCEEDED": {
        "jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "message": "Job finished successfully.",
    },
    "Complete/STOPPED": {
        "jobDeploymentStatus": "Complete", "jobStatus": "STOPPED", "message": "Job was intentionally stopped.",
    },
    "Failed/AppFailed": {
        "jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed", "message": RAY_FAILED_LOG,
    },
    "Failed/DeadlineExceeded": {
        "jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
        "message": f"The RayJob has passed the activeDeadlineSeconds. StartTime: {START_GO}. "
        f"ActiveDeadlineSeconds: {DEADLINE_S}",
    },
    "Failed/SubmissionFailed": {
        "jobDeploymentStatus": "Failed", "reason": "SubmissionFailed",
        "message": "Job submission has failed. Reason: BackoffLimitExceeded. "
        "Message: Job has reached the specified backoff limit",
    },
    "ValidationFailed": {
        "jobDeploymentStatus": "ValidationFailed", "reason": "ValidationFailed",
        "message": "The RayJob metadata is invalid: RayJob name should be no more than 47 characters",
    },
}  # fmt: skip


def rayjob(name: str, state: str) -> dict:
    """The RayJob ``name`` in ``state`` (a key of STATES)."""
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": "5f0c3a4e-2b1d-4c8e-9a57-1e2f3d4c5b6a",
            "generation": 1,
            "resourceVersion": "48213377",
            "creationTimestamp": START,
            "finalizers": ["ray.io/rayjob-finalizer"],
            "labels": {"app.kubernetes.io/instance": name, "app.kubernetes.io/name": "verl-npu"},
        },
        "spec": {
            "entrypoint": "bash /opt/verl-npu/src/verl-npu/ci/nightly/run_job.sh multinode_grpo",
            "submissionMode": "K8sJobMode",
            "backoffLimit": 0,
            "activeDeadlineSeconds": DEADLINE_S,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
        },
    }
    status = copy.deepcopy(STATES[state])
    if not status:
        return doc
    deployment = status["jobDeploymentStatus"]
    if deployment != "ValidationFailed":  # a refused RayJob gets only the verdict
        status |= {
            "jobId": f"{name}-8x2kq",
            "rayClusterName": f"{name}-tb6l9",
            "startTime": START,
            "observedGeneration": 1,
            "succeeded": 1 if status.get("jobStatus") == "SUCCEEDED" else 0,
            "failed": 1 if deployment == "Failed" else 0,
        }
    if status.get("jobStatus"):
        status["dashboardURL"] = f"{name}-tb6l9-head-svc.default.svc.cluster.local:8265"
        status["rayJobInfo"] = {"startTime": START}
    if deployment in ("Complete", "Failed"):
        status["endTime"] = END
    doc["status"] = status
    return doc


def write_states(directory: Path, name: str, states: list[str]) -> None:
    """What successive `kubectl get rayjob/NAME -o json` calls answer: one file per poll, in order; the
    stand-in repeats the last. "NotFound" and "Unreachable" make that poll answer as kubectl does for a deleted
    object and for an API server that does not answer."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for index, state in enumerate(states, 1):
        if state in ("NotFound", "Unreachable"):
            (directory / f"{index:03d}.{state.lower()}").write_text("")
        else:
            (directory / f"{index:03d}.json").write_text(json.dumps(rayjob(name, state), indent=4) + "\n")
