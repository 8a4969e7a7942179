"""The multi-node workflow: render -> validate -> apply -> wait -> copy results -> always clean up, and the
ci/k8s scripts it runs, exercised against a stand-in kubectl that records its calls."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github/workflows/multinode.yml"


@pytest.fixture(scope="module")
def job() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]["rayjob"]


def step_index(job: dict, needle: str) -> int:
    """Index of the one step whose `run` or `uses` contains ``needle``."""
    found = [i for i, s in enumerate(job["steps"]) if needle in s.get("run", "") + s.get("uses", "")]
    assert len(found) == 1, (needle, found)
    return found[0]


def test_python_is_set_up_before_install(job):
    setup = step_index(job, "actions/setup-python")
    assert str(job["steps"][setup]["with"]["python-version"]) == "3.12"
    assert setup < step_index(job, "bash install.sh --dev")


def test_render_validate_apply_copy_upload_then_always_clean_up_in_that_order(job):
    steps = job["steps"]
    render, validate = step_index(job, "verl-npu k8s render rayjob"), step_index(job, "verl-npu k8s validate")
    assert render < validate or steps[render]["run"].index("k8s render") < steps[render]["run"].index("k8s validate")
    assert "-o k8s-out/rayjob.yaml" in steps[render]["run"]
    assert "verl-npu k8s validate k8s-out/rayjob.yaml" in steps[validate]["run"]
    order = [
        step_index(job, "bash install.sh --dev"),
        render,
        validate,
        step_index(job, "ci/k8s/submit_rayjob.sh k8s-out/rayjob.yaml"),
        step_index(job, "ci/k8s/copy_results.sh"),
        step_index(job, "actions/upload-artifact"),
        step_index(job, "ci/k8s/cleanup.sh"),
    ]
    assert order == sorted(order) and len(set(order[2:])) == len(order[2:])
    assert "rayjob-multinode.yaml" not in WORKFLOW.read_text() and "envsubst" not in WORKFLOW.read_text()
    copy, upload, cleanup = steps[order[4]], steps[order[5]], steps[order[6]]
    assert cleanup["if"] == "always()" and '"$NAME"' in cleanup["run"]
    assert copy["if"].startswith("always()") and upload["if"] == "always()"
    assert "multinode-out" in upload["with"]["path"]
    assert copy["run"].split()[-1].startswith("multinode-out")


def test_names_are_unique_per_run_attempt_and_the_image_is_this_commits(job):
    name = job["env"]["NAME"]
    assert "${{ github.run_id }}" in name and "${{ github.run_attempt }}" in name
    assert job["env"]["RUN_DIR"].endswith(name) and job["env"]["RUN_DIR"].startswith("/root/.cache/")
    assert job["env"]["IMAGE"] == "${{ needs.images.outputs.a3 }}"
    render = job["steps"][step_index(job, "verl-npu k8s render rayjob")]["run"]
    assert '--name "$NAME"' in render and '--image "$IMAGE"' in render and "--results-pod" in render


# --- the scripts, against a stand-in kubectl --------------------------------------------------------

FAKE_KUBECTL = r"""#!/usr/bin/env bash
# records each call; answers from files in $FAKE (access modes, the RayJob's successive states)
printf '%s\n' "$*" >>"$FAKE/calls"
case "$*" in
  *"--dry-run=server"*"-o jsonpath"*) printf 'shared\nshared\n' ;;
  *"--dry-run=server"*) ;;
  "get pvc "*) cat "$FAKE/modes" ;;
  "get rayjob/"*"-o jsonpath"*)
    n=$(($(cat "$FAKE/polls" 2>/dev/null || echo 0) + 1)); echo "$n" >"$FAKE/polls"
    sed -n "${n}p" "$FAKE/states" | grep . || tail -n 1 "$FAKE/states" ;;
  "logs job/"*) echo "step:15 - done" ;;
  "wait "*) [[ -f "$FAKE/pod-ready" ]] ;;
  "exec "*"test -d"*) [[ -f "$FAKE/results-exist" ]] ;;
  "cp "*) mkdir -p "${@: -1}" && echo log >"${@: -1}/train.log" ;;
  "get pod/"*) [[ -f "$FAKE/pod-ready" ]] ;;
esac
"""


@pytest.fixture
def kubectl(tmp_path: Path) -> Path:
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "kubectl").write_text(FAKE_KUBECTL)
    (fake / "bin" / "kubectl").chmod(0o755)
    (fake / "modes").write_text('["ReadWriteMany"]\n')
    (fake / "states").write_text("Initializing/\nRunning/RUNNING\nComplete/SUCCEEDED\n")
    return fake


def run(script: str, fake: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE": str(fake), "POLL_S": "0"}
    return subprocess.run(["bash", str(REPO / script), *args], capture_output=True, text=True, env=env, cwd=cwd)


def calls(fake: Path) -> list[str]:
    return (fake / "calls").read_text().splitlines() if (fake / "calls").exists() else []


def test_submit_applies_waits_for_success_and_keeps_the_logs(kubectl, tmp_path):
    manifest = tmp_path / "rayjob.yaml"
    manifest.write_text("kind: RayJob\n")
    done = run("ci/k8s/submit_rayjob.sh", kubectl, str(manifest), "job-1", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = calls(kubectl)
    assert made[0] == f"apply --dry-run=server -f {manifest}"
    assert made.index("get pvc shared -o jsonpath={.spec.accessModes}") < made.index(f"apply -f {manifest}")
    assert sum(c.startswith("get rayjob/job-1") for c in made) >= 3  # polled until Complete
    assert (tmp_path / "out/submitter.log").read_text() == "step:15 - done\n"
    assert "Running/RUNNING" in done.stdout and "RayJob job-1: Complete/SUCCEEDED" in done.stdout


def test_submit_fails_a_failed_job_and_refuses_a_claim_that_is_not_read_write_many(kubectl, tmp_path):
    manifest = tmp_path / "rayjob.yaml"
    manifest.write_text("kind: RayJob\n")
    (kubectl / "states").write_text("Running/RUNNING\nFailed/FAILED\n")
    assert run("ci/k8s/submit_rayjob.sh", kubectl, str(manifest), "job-1", "out", cwd=tmp_path).returncode == 1
    (kubectl / "calls").unlink()
    (kubectl / "modes").write_text('["ReadWriteOnce"]\n')
    done = run("ci/k8s/submit_rayjob.sh", kubectl, str(manifest), "job-1", "out", cwd=tmp_path)
    assert done.returncode == 2
    assert "claim shared has access modes" in done.stderr and "ReadWriteMany" in done.stderr
    assert f"apply -f {manifest}" not in calls(kubectl)  # nothing was created


def test_copy_results_through_the_results_pod(kubectl, tmp_path):
    (kubectl / "pod-ready").touch()
    (kubectl / "results-exist").touch()
    done = run("ci/k8s/copy_results.sh", kubectl, "job-1", "/root/.cache/r", "out/results", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "cp job-1-results:/root/.cache/r out/results" in calls(kubectl)
    assert (tmp_path / "out/results/train.log").is_file()
    (kubectl / "results-exist").unlink()
    done = run("ci/k8s/copy_results.sh", kubectl, "job-1", "/root/.cache/r", "out2", cwd=tmp_path)
    assert done.returncode == 1 and "the launch wrote no results" in done.stderr


def test_cleanup_deletes_everything_of_the_run_by_label_even_without_a_manifest(kubectl, tmp_path):
    (kubectl / "pod-ready").touch()
    done = run("ci/k8s/cleanup.sh", kubectl, "job-1", "/root/.cache/verl-npu/runs/job-1/job", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = calls(kubectl)
    scratch = made.index("exec job-1-results -- rm -rf /root/.cache/verl-npu/runs/job-1/job")
    delete = made.index(
        "delete rayjob,configmap,pod -l app.kubernetes.io/instance=job-1 --ignore-not-found --wait=false"
    )
    assert scratch < delete  # the scratch goes through the results pod before the pod is deleted
    assert "delete raycluster -l ray.io/originated-from-cr-name=job-1 --ignore-not-found --wait=false" in made
