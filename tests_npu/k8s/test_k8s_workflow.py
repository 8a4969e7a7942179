"""The multi-node workflow: render -> validate -> apply -> wait -> copy results -> always clean up, and the
ci/k8s scripts it runs, exercised against a stand-in kubectl that records its calls."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.kuberay_rayjob import write_states
from support.paths import REPO

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

STANDIN = REPO / "tests_npu/support/kubectl_standin.py"


@pytest.fixture
def kubectl(tmp_path: Path) -> Path:
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "kubectl").symlink_to(STANDIN)
    (fake / "bin" / "python3").symlink_to(sys.executable)  # the stand-in's and the scripts' (no pyenv shim: fast)
    (fake / "modes").write_text('["ReadWriteMany"]\n')
    write_states(fake / "rayjob", "job-1", ["Initializing", "Running", "Complete/SUCCEEDED"])
    return fake


def run(script: str, fake: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE": str(fake), "POLL_S": "0",
           "WAIT_S": "60", **env}  # fmt: skip
    return subprocess.run(["bash", str(REPO / script), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300, check=False)  # fmt: skip


def calls(fake: Path) -> list[str]:
    return (fake / "calls").read_text().splitlines() if (fake / "calls").exists() else []


def polls(fake: Path) -> int:
    return sum(c == "get rayjob/job-1 -o json" for c in calls(fake))


def submit(kubectl: Path, tmp_path: Path, states: list[str], **env: str) -> subprocess.CompletedProcess:
    manifest = tmp_path / "rayjob.yaml"
    manifest.write_text("kind: RayJob\n")
    write_states(kubectl / "rayjob", "job-1", states)
    (kubectl / "calls").unlink(missing_ok=True)
    (kubectl / "polls").unlink(missing_ok=True)
    return run("ci/k8s/submit_rayjob.sh", kubectl, str(manifest), "job-1", "out", cwd=tmp_path, **env)


def test_submit_applies_waits_for_success_and_keeps_the_logs(kubectl, tmp_path):
    manifest = tmp_path / "rayjob.yaml"
    manifest.write_text("kind: RayJob\n")
    done = run("ci/k8s/submit_rayjob.sh", kubectl, str(manifest), "job-1", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = calls(kubectl)
    assert made[0] == f"apply --dry-run=server -f {manifest}"
    assert made.index("get pvc shared -o jsonpath={.spec.accessModes}") < made.index(f"apply -f {manifest}")
    assert polls(kubectl) == 3  # polled until Complete, not once more
    assert (tmp_path / "out/submitter.log").read_text() == "step:15 - done\n"
    assert "deployment/job status Running/RUNNING" in done.stdout
    assert done.stdout.rstrip().endswith(
        "RayJob job-1: deployment status Complete, job status SUCCEEDED, reason none: Job finished successfully."
    )


# every state KubeRay v1.7 leaves a RayJob in (docs/kuberay_rayjob.md): the exit code and what the last line names
ENDS = [
    ("Failed/AppFailed", 1, ["job status FAILED, reason AppFailed: Job entrypoint command failed with exit code 1,",
                             "critic/rewards/mean:0.031 RuntimeError: HCCL function error"]),
    ("Failed/DeadlineExceeded", 1, ["deployment status Failed, job status RUNNING, reason DeadlineExceeded: The "
                                    "RayJob has passed the activeDeadlineSeconds.", "ActiveDeadlineSeconds: 11100"]),
    ("Failed/SubmissionFailed", 1, ["job status none, reason SubmissionFailed: Job submission has failed. "
                                    "Reason: BackoffLimitExceeded."]),
    ("Complete/STOPPED", 1, ["deployment status Complete, job status STOPPED, reason none: Job was intentionally "
                             "stopped."]),
    ("ValidationFailed", 2, ["deployment status ValidationFailed, job status none, reason ValidationFailed: The "
                             "RayJob metadata is invalid: RayJob name should be no more than 47 characters"]),
]  # fmt: skip


@pytest.mark.parametrize(("state", "code", "named"), ENDS, ids=[end[0] for end in ENDS])
def test_submit_stops_waiting_at_every_end_and_names_its_status_reason_and_message(kubectl, tmp_path, state, code,
                                                                                    named):  # fmt: skip
    done = submit(kubectl, tmp_path, ["New", "Initializing", state])
    assert done.returncode == code, done.stdout + done.stderr
    assert polls(kubectl) == 3, "the wait went on past the end"
    for text in named:
        assert text in done.stdout, (text, done.stdout)
    assert (tmp_path / "out/submitter.log").is_file() and (tmp_path / "out/rayjob-status.yaml").is_file()
    if state == "ValidationFailed":
        assert "KubeRay refused the RayJob's spec: nothing ran" in done.stderr


def test_submit_waits_through_suspension_and_a_passing_api_error(kubectl, tmp_path):
    done = submit(kubectl, tmp_path, ["Suspended", "Unreachable", "Running", "Complete/SUCCEEDED"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert polls(kubectl) == 4
    assert "deployment/job status Suspended/none" in done.stdout
    assert "unreadable: Unable to connect to the server" in done.stdout


def test_submit_ends_when_the_rayjob_is_gone_or_the_wait_runs_out(kubectl, tmp_path):
    done = submit(kubectl, tmp_path, ["Running", "NotFound"])
    assert done.returncode == 1 and polls(kubectl) == 2
    assert "RayJob job-1 no longer exists" in done.stderr and "last seen: Running/RUNNING" in done.stderr
    done = submit(kubectl, tmp_path, ["Running"], WAIT_S="1", POLL_S="0.2")
    assert done.returncode == 1
    assert "RayJob job-1 not finished after 1 s; RayJob job-1: deployment status Running, job status RUNNING" in (
        done.stderr
    )


@pytest.mark.parametrize(("setting", "value"), [("WAIT_S", "١٦"), ("WAIT_S", "0"), ("WAIT_S", "1e3"), ("POLL_S", "-1"),
                                                ("POLL_S", "\uff13"), ("POLL_S", "1;2")])  # fmt: skip
def test_submit_refuses_a_bad_wait_before_creating_anything(kubectl, tmp_path, setting, value):
    done = submit(kubectl, tmp_path, ["Running"], **{setting: value})
    assert done.returncode == 2 and f"submit_rayjob.sh: {setting}='{value}': expected" in done.stderr
    assert calls(kubectl) == []


def test_submit_fails_a_failed_job_and_refuses_a_claim_that_is_not_read_write_many(kubectl, tmp_path):
    assert submit(kubectl, tmp_path, ["Running", "Failed/AppFailed"]).returncode == 1
    (kubectl / "modes").write_text('["ReadWriteOnce"]\n')
    done = submit(kubectl, tmp_path, ["Running"])
    assert done.returncode == 2
    assert "claim shared has access modes" in done.stderr and "ReadWriteMany" in done.stderr
    assert not any(c.startswith("apply -f") for c in calls(kubectl))  # nothing was created


def test_submit_refuses_without_kubectl_naming_what_the_runner_needs(tmp_path):
    manifest = tmp_path / "rayjob.yaml"
    manifest.write_text("kind: RayJob\n")
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("mkdir", "python3"):
        (bare / tool).symlink_to(shutil.which(tool))
    done = subprocess.run([shutil.which("bash"), str(REPO / "ci/k8s/submit_rayjob.sh"), str(manifest), "job-1", "out"],
                          cwd=tmp_path, env={"PATH": str(bare)}, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 2
    assert "kubectl is not on PATH: the runner needs kubectl with access to the cluster" in done.stderr


def test_the_job_checks_its_cluster_access_before_anything_is_created(job, kubectl, tmp_path):
    access = step_index(job, "kubectl auth can-i create rayjobs.ray.io")
    assert step_index(job, "bash install.sh --dev") < access < step_index(job, "ci/k8s/submit_rayjob.sh")
    step = job["steps"][access]
    assert step["env"] == {"ASCEND_KUBECONFIG": "${{ secrets.ASCEND_KUBECONFIG }}"}
    github_env = tmp_path / "github_env"
    runner_temp = tmp_path / "runner_temp"
    runner_temp.mkdir()

    def check(**env: str) -> subprocess.CompletedProcess:
        github_env.write_text("")
        path = f"{kubectl / 'bin'}:{os.environ['PATH']}"
        env = {**os.environ, "PATH": path, "FAKE": str(kubectl), "GITHUB_ENV": str(github_env),
               "RUNNER_TEMP": str(runner_temp), "ASCEND_KUBECONFIG": "", **env}  # fmt: skip
        return subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, timeout=60,
                              check=False, env=env)  # fmt: skip

    done = check()  # no secret: the runner pod's service account
    assert done.returncode == 0, done.stdout + done.stderr
    assert github_env.read_text() == "" and (kubectl / "kubeconfig-seen").read_text() == ""
    done = check(ASCEND_KUBECONFIG="apiVersion: v1\nkind: Config\n")
    assert done.returncode == 0, done.stdout + done.stderr
    kubeconfig = runner_temp / "kubeconfig"
    assert kubeconfig.read_text().strip() == "apiVersion: v1\nkind: Config" and kubeconfig.stat().st_mode & 0o077 == 0
    assert github_env.read_text() == f"KUBECONFIG={kubeconfig}\n"
    assert (kubectl / "kubeconfig-seen").read_text() == str(kubeconfig)
    (kubectl / "can-i").write_text("no\n")
    done = check()
    assert done.returncode == 1 and "::error::these credentials cannot create RayJobs" in done.stdout


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
