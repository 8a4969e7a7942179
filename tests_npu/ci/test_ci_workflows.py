"""The CI definitions: workflows lint, every path they use exists, images only by manifest-derived tags,
every nightly job has its script and baseline and passes preflight."""

from __future__ import annotations

import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.paths import REPO

from verl_npu.ci.compare import DEFAULT_LIMITS, read_baseline
from verl_npu.ci.images import TAG, image_tag, manifest_digest

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
EXPRESSION = re.compile(r"\$\{\{.*?\}\}")
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|ci|examples|docker|tests_npu|bench)/[\w./${}-]+|install\.sh)")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def steps(workflow: dict):
    for job in workflow["jobs"].values():
        yield from job.get("steps", [])


def test_there_are_pr_image_nightly_and_multinode_workflows():
    assert {p.stem for p in WORKFLOWS} >= {"pr", "images", "nightly", "multinode"}


def test_every_workflow_validates_against_the_github_workflow_schema():
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    done = subprocess.run(
        [checker, "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_run_block_is_shellcheck_clean(tmp_path):
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    scripts = []
    for workflow in WORKFLOWS:
        for index, step in enumerate(steps(load(workflow))):
            if "run" in step:
                script = tmp_path / f"{workflow.stem}_{index}.sh"
                # GitHub substitutes ${{ }} before bash runs; shellcheck sees a plain word there
                script.write_text("#!/usr/bin/env bash\n" + EXPRESSION.sub("EXPR", step["run"]) + "\n")
                scripts.append(str(script))
    assert scripts
    done = subprocess.run([shellcheck, "--severity=style", *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def referenced_paths(text: str) -> set[str]:
    """Repository paths named in shell text (comments skipped; paths built from variables left out)."""
    code = "\n".join(line for line in EXPRESSION.sub("", text).splitlines() if not line.lstrip().startswith("#"))
    return {m.rstrip(".") for m in REPO_PATH.findall(code) if "$" not in m}


def test_every_path_a_workflow_or_ci_script_references_exists():
    texts = {p: p.read_text() for p in [*sorted((REPO / "ci").rglob("*.sh")), *sorted((REPO / "ci").rglob("*.yaml"))]}
    texts |= {p: "\n".join(s["run"] for s in steps(load(p)) if "run" in s) for p in WORKFLOWS}
    missing = []
    for source, text in texts.items():
        for path in referenced_paths(text):
            if not (REPO / path).exists():
                missing.append(f"{source.relative_to(REPO)} -> {path}")
    for workflow in WORKFLOWS:
        for step in steps(load(workflow)):
            if step.get("uses", "").startswith("./") and not (REPO / step["uses"]).exists():
                missing.append(f"{workflow.name} uses {step['uses']}")
        for job in load(workflow)["jobs"].values():
            if job.get("uses", "").startswith("./") and not (REPO / job["uses"]).exists():
                missing.append(f"{workflow.name} uses {job['uses']}")
    assert not missing, missing
    assert "ci/nightly/run_job.sh" in referenced_paths(texts[REPO / ".github/workflows/nightly.yml"])


def nightly_jobs() -> list[str]:
    matrix = load(REPO / ".github/workflows/nightly.yml")["jobs"]["e2e"]["strategy"]["matrix"]["include"]
    return [entry["job"] for entry in matrix]


def test_every_nightly_job_has_a_script_a_baseline_with_upstreams_limits_and_calls_doctor_first():
    jobs = [*nightly_jobs(), "multinode_grpo"]
    assert set(jobs) >= {"dense_grpo_offload", "dsa_glm5_small", "ckpt_resume_offload"}
    runner = (REPO / "ci/nightly/run_job.sh").read_text()
    assert runner.index("verl-npu doctor") < runner.index('bash "$SCRIPT"') < runner.index("verl-npu ci compare")
    for job in jobs:
        assert (REPO / "ci/nightly/jobs" / f"{job}.sh").is_file(), job
        baseline = read_baseline(REPO / "ci/baselines" / f"{job}.json")
        assert baseline.window == (5, 14)
        for metric, (kind, key, amount) in DEFAULT_LIMITS.items():
            limit = baseline.limits[metric]
            assert limit.kind == kind and getattr(limit, key) == amount, (job, metric)
        assert "image" in json.loads((REPO / "ci/baselines" / f"{job}.json").read_text())
    for script in (REPO / "ci/nightly/jobs").glob("*.sh"):
        text = script.read_text()
        # a job either takes the env file itself or sources another job's launch that does
        launch = re.search(r'^source "\$\{BASH_SOURCE\[0\]%/\*\}/(\w+\.sh)"$', text, re.MULTILINE)
        base = (script.parent / launch[1]).read_text() if launch else text
        assert 'source "$NIGHTLY_DIR/nightly.env"' in base, f"{script.name} must take the shared env file"
        assert text.count("export ") == 0, f"{script.name}: shared settings belong in nightly.env"


def test_images_are_referenced_only_by_manifest_derived_tags():
    for workflow in WORKFLOWS:
        text = workflow.read_text()
        assert ":latest" not in text, workflow.name
        for job in load(workflow)["jobs"].values():
            image = (job.get("container") or {}).get("image")
            if image is not None:
                assert re.fullmatch(r"\$\{\{ needs\.images\.outputs\[matrix\.chip\] \}\}", image), image
    for manifest in sorted((REPO / "ci").rglob("*.yaml")):  # hand-written manifests take the tag as ${IMAGE}
        assert set(re.findall(r"image: (\S+)", manifest.read_text())) <= {"${IMAGE}"}, manifest.name
    assert "python3 -m verl_npu.ci.images" in (REPO / "ci/images/build.sh").read_text()


def test_image_tag_is_chip_manifest_hash_and_commit(tmp_path):
    tag = image_tag("a3", "0123456789abcdef0123456789abcdef01234567")
    _, _, name = tag.rpartition("/")
    repository, _, version = name.partition(":")
    assert repository == "verl-npu" and TAG.match(version)
    assert version == f"a3-{manifest_digest()}-0123456789ab"
    changed = tmp_path / "stack.toml"
    changed.write_text(
        (REPO / "verl_npu/stack/stack.toml").read_text().replace('version = "0.9.1"', 'version = "0.9.2"')
    )
    assert manifest_digest(changed) != manifest_digest()
    assert image_tag("a3", "0123456789ab", manifest=changed).endswith(f"a3-{manifest_digest(changed)}-0123456789ab")
    with pytest.raises(ValueError, match="chip 'a9'"):
        image_tag("a9", "0123456789ab")
    with pytest.raises(ValueError, match="commit 'latest'"):
        image_tag("a3", "latest")


def test_every_nightly_and_multinode_launch_passes_preflight():
    from verl_npu.preflight import run_preflight

    for script in sorted((REPO / "ci/nightly/jobs").glob("*.sh")):
        directive = next(line for line in script.read_text().splitlines() if line.startswith("# preflight: "))
        options = shlex.split(directive.removeprefix("# preflight: "))
        chip, model = options[options.index("--chip") + 1], options[options.index("--model-config") + 1]
        report = run_preflight(script, chip=chip, model_config=str(REPO / model))
        assert report.verdict == "go", (script.name, [c for c in report.checks if c.status == "fail"])


def test_build_manifest_verify_passes_on_its_own_environment_and_names_what_differs(tmp_path):
    from verl_npu.stack import build_manifest
    from verl_npu.stack.manifest import load_stack

    stack = load_stack()
    doc = build_manifest.compose(stack, "dev", {})  # this venv, as install.sh --dev made it
    path = tmp_path / "build-manifest.json"
    path.write_text(json.dumps(doc))
    assert build_manifest.verify(stack, "dev", path) == []
    doc["versions"]["verl"]["installed"] = "0.9.0"
    doc["target"] = "a3"
    path.write_text(json.dumps(doc))
    problems = build_manifest.verify(stack, "dev", path)
    assert "target: built for 'a3', expected 'dev'" in problems
    assert "verl: build manifest records 0.9.0, the stack pins 0.9.1" in problems


# --- Ascend runners, the runner cache layout, image builds ------------------------------------------------------

ASCEND_RUNNER = re.compile(r"linux-aarch64-(?:a2b3|a3)-(\d+)")
NIGHTLY_JOBS = ("dense_grpo_offload", "ckpt_resume_offload", "dsa_glm5_small", "multinode_grpo")


def ascend_jobs() -> list[tuple[str, str, dict]]:
    """(workflow, job name, job) of every job that runs on a self-hosted Ascend runner."""
    found = []
    for workflow in WORKFLOWS:
        for name, job in load(workflow)["jobs"].items():
            runners = [e.get("runner", "") for e in job.get("strategy", {}).get("matrix", {}).get("include", [])]
            if any(ASCEND_RUNNER.fullmatch(r) for r in [*runners, str(job.get("runs-on", ""))]):
                found.append((workflow.name, name, job))
    return found


def test_ascend_jobs_give_their_container_only_an_image_and_credentials_and_run_login_shells():
    jobs = ascend_jobs()
    assert {name for _, name, _ in jobs} >= {"npu-tests", "e2e"}
    for workflow, name, job in jobs:
        # Kubernetes-mode runners drop docker create options: devices and mounts come from the pod template
        assert set(job["container"]) <= {"image", "credentials"}, (workflow, name, sorted(job["container"]))
        assert "options" not in job["container"], (workflow, name)
        for step in job["steps"]:
            assert step.get("shell", "bash -el {0}") == "bash -el {0}", (workflow, name, step)
    nightly = load(REPO / ".github/workflows/nightly.yml")
    assert nightly["defaults"]["run"]["shell"] == "bash -el {0}"
    assert "--privileged" not in (REPO / ".github/workflows/nightly.yml").read_text()


def test_every_job_container_pulls_with_credentials():
    containers = [
        (workflow.name, name, job["container"])
        for workflow in WORKFLOWS
        for name, job in load(workflow)["jobs"].items()
        if "container" in job
    ]
    assert containers
    for workflow, name, container in containers:
        credentials = container.get("credentials") or {}
        assert credentials.get("username") == "${{ github.actor }}", (workflow, name)
        assert re.fullmatch(r"\$\{\{ secrets\.\w+ \}\}", credentials.get("password", "")), (workflow, name)


def test_ascend_jobs_check_npu_smi_first_and_tell_doctor_how_many_npus_they_expect():
    for workflow, name, job in ascend_jobs():
        steps = job["steps"]
        assert steps[0].get("uses", "").startswith("actions/checkout@"), (workflow, name)
        assert steps[1].get("run") == "bash ci/nightly/check_npus.sh", (workflow, name, steps[1])
        assert job["env"]["VERL_NPU_EXPECT_NPUS"] == "${{ matrix.npus }}", (workflow, name)
        for entry in job["strategy"]["matrix"]["include"]:
            # the runner label ends in the node's NPU count: 8 on A2, 16 on A3
            assert entry["npus"] == int(ASCEND_RUNNER.fullmatch(entry["runner"])[1]), (workflow, name, entry)
    npu_tests = load(REPO / ".github/workflows/nightly.yml")["jobs"]["npu-tests"]
    assert any("verl-npu doctor" in step.get("run", "") for step in npu_tests["steps"])
    runner = (REPO / "ci/nightly/run_job.sh").read_text()
    assert runner.index("check_npus.sh") < runner.index("verl-npu doctor")


def run_bash(script: Path, *args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)


@pytest.fixture
def bare_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has the shell tools but no npu-smi (and no CANN under ASCEND_ROOT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "ASCEND_ROOT": str(tmp_path / "no-ascend")}


def fake_npu_smi(env: dict[str, str], body: str) -> None:
    tool = Path(env["PATH"].split(":")[0]) / "npu-smi"
    tool.write_text(f"#!/usr/bin/env bash\n{body}\n")
    tool.chmod(0o755)


def test_check_npus_fails_with_the_fix_when_npu_smi_is_missing_or_broken(bare_path):
    check = REPO / "ci/nightly/check_npus.sh"
    done = run_bash(check, env=bare_path)
    assert done.returncode == 1
    assert "npu-smi is not on PATH" in done.stderr and "pod template" in done.stderr, done.stderr
    fake_npu_smi(bare_path, 'echo "dcmi module initialize failed. ret is -8005" >&2; exit 3')
    done = run_bash(check, env=bare_path)
    assert done.returncode == 1
    assert '"npu-smi info" failed' in done.stderr and "ret is -8005" in done.stderr, done.stderr
    fake_npu_smi(bare_path, '[[ "$1" == info ]] && echo "| 0     910B1 | OK |"')
    done = run_bash(check, env=bare_path)
    assert done.returncode == 0, done.stderr
    assert "910B1" in done.stdout


def test_run_job_stops_at_the_npu_check_when_the_job_expects_npus(bare_path, tmp_path):
    out = tmp_path / "out"
    env = {**bare_path, "VERL_NPU_EXPECT_NPUS": "8", "NIGHTLY_IMAGE": "ghcr.io/o/verl-npu:x", "NIGHTLY_COMMIT": "abc"}
    done = run_bash(REPO / "ci/nightly/run_job.sh", "dense_grpo_offload", str(out), env=env)
    assert done.returncode == 1
    assert "npu-smi is not on PATH" in done.stderr, done.stderr
    assert not (out / "doctor.md").exists(), "doctor ran although the NPU check failed"
    assert (out / "run.env").read_text() == "JOB=dense_grpo_offload\nIMAGE=ghcr.io/o/verl-npu:x\nCOMMIT=abc\n"


def nightly_env() -> dict[str, str]:
    from verl_npu.runtime_patches.ray_runtime_env import env_file_variables

    return env_file_variables(str(REPO / "ci/nightly/nightly.env"))


OLD_MOUNT = re.compile(r"(?<![\w.~-])/(?:models|data)(?![\w.-])")


def test_nightly_reads_the_runner_cache_layout_and_no_docker_mounts():
    env = nightly_env()
    assert env["MODEL_ROOT"] == "/root/.cache/models"
    assert env["DATASET_ROOT"] == "/root/.cache/datasets"
    texts = {p: p.read_text() for p in [*(REPO / "ci/nightly").rglob("*.sh"), REPO / "ci/nightly/nightly.env"]}
    texts |= {p: p.read_text() for p in WORKFLOWS if p.name != "multinode.yml"}  # multinode: the k8s side
    for path, text in texts.items():
        assert not OLD_MOUNT.search(text), f"{path.relative_to(REPO)}: {OLD_MOUNT.search(text)[0]}"


def test_every_nightly_job_prepares_its_own_gsm8k_and_trains_on_it():
    from verl_npu.preflight.launch import read_launch_script

    env = nightly_env()
    for job in NIGHTLY_JOBS:
        script = REPO / "ci/nightly/jobs" / f"{job}.sh"
        launch = read_launch_script(script)
        overrides = dict(o.split("=", 1) for o in launch.overrides if "=" in o)
        job_dir = launch.variables["JOB_DIR"]
        assert job_dir == f"{env['WORK_ROOT']}/{job}", (job, job_dir)
        assert overrides["data.train_files"] == f"{job_dir}/gsm8k/train.parquet", job
        assert overrides["data.val_files"] == f"{job_dir}/gsm8k/test.parquet", job
        model = overrides["actor_rollout_ref.model.path"]
        assert model.startswith(f"{job_dir}/") or model.startswith(f"{env['MODEL_ROOT']}/Qwen/"), (job, model)
        # the preparation runs in the launch the trainer runs in (multinode_grpo through dsa_glm5_small.sh)
        base = script.read_text()
        if "source" in base and "dsa_glm5_small.sh" in base:
            base = (REPO / "ci/nightly/jobs/dsa_glm5_small.sh").read_text()
        prepare = 'python3 -m verl_npu.ci.gsm8k "$DATASET_ROOT/openai/gsm8k" "$JOB_DIR/gsm8k"'
        assert base.index(prepare) < base.index("python3 -m verl.trainer.main_ppo"), job


def test_the_small_glm5_job_makes_its_model_from_the_shipped_config_and_tokenizer():
    text = (REPO / "ci/nightly/jobs/dsa_glm5_small.sh").read_text()
    assert 'python3 "$NIGHTLY_DIR/make_glm5_small.py" "$NIGHTLY_DIR/models/glm5_small" "$MODEL_DIR"' in text
    assert "GLM-5.2" not in (REPO / "ci/nightly/make_glm5_small.py").read_text()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (REPO / "ci/nightly/models/glm5_small" / name).is_file(), name


def image_jobs() -> dict[str, dict]:
    return load(REPO / ".github/workflows/images.yml")["jobs"]


def test_images_are_built_natively_per_architecture_then_merged_and_verified_per_platform():
    text = (REPO / ".github/workflows/images.yml").read_text() + (REPO / "ci/images/build.sh").read_text()
    assert "setup-qemu-action" not in text and "linux/amd64,linux/arm64" not in text
    jobs = image_jobs()
    for name in ("build", "verify"):
        matrix = jobs[name]["strategy"]["matrix"]
        assert matrix["chip"] == ["a2", "a3"] and matrix["arch"] == ["amd64", "arm64"], name
        runners = {entry["arch"]: entry["runner"] for entry in matrix["include"]}
        assert runners == {"amd64": "ubuntu-24.04", "arm64": "ubuntu-24.04-arm"}, name
        assert jobs[name]["runs-on"] == "${{ matrix.runner }}", name
        runs = [step.get("run", "") for step in jobs[name]["steps"]]
        assert runs.index("bash ci/images/free_disk.sh") < next(i for i, r in enumerate(runs) if "build.sh" in r)
    assert "build.sh build " in str(jobs["build"]["steps"]) and "build.sh verify " in str(jobs["verify"]["steps"])
    assert jobs["merge"]["needs"] == ["plan", "build"] and jobs["verify"]["needs"] == ["plan", "merge"]
    assert "build.sh merge " in str(jobs["merge"]["steps"])
    build = (REPO / "ci/images/build.sh").read_text()
    assert "docker buildx imagetools create" in build
    assert "-m verl_npu.stack.build_manifest verify" in build
    # callers (nightly, multinode) get the multi-arch tags
    outputs = load(REPO / ".github/workflows/images.yml")[True]["workflow_call"]["outputs"]
    assert {chip: o["value"] for chip, o in outputs.items()} == {
        "a2": "${{ jobs.plan.outputs.a2 }}",
        "a3": "${{ jobs.plan.outputs.a3 }}",
    }


def test_build_sh_refuses_an_architecture_other_than_the_runners(tmp_path):
    other = {"x86_64": "arm64", "aarch64": "amd64"}[platform.machine()]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for command in (
        ["build", "a2", other, "0123456789ab", "ghcr.io/o"],
        ["verify", "a3", other, "0123456789ab", "ghcr.io/o"],
    ):
        done = run_bash(REPO / "ci/images/build.sh", *command, env=env)
        assert done.returncode == 2
        assert f"asked for {other} on this" in done.stderr and "ubuntu-24.04-arm" in done.stderr, done.stderr


def test_the_registry_is_the_lowercased_repository_owner_never_a_fixed_one(tmp_path):
    for path in [*WORKFLOWS, REPO / "ci/images/build.sh", REPO / "verl_npu/ci/images.py", REPO / "verl_npu/cli.py"]:
        assert "ghcr.io/verl-npu" not in path.read_text(), path.name
    plan = image_jobs()["plan"]["steps"][-1]
    assert plan["env"]["OWNER"] == "${{ github.repository_owner }}"
    assert plan["run"] == 'bash ci/images/build.sh plan "$OWNER" "$COMMIT"'
    output = tmp_path / "github_output"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "GITHUB_OUTPUT": str(output)}
    done = run_bash(REPO / "ci/images/build.sh", "plan", "My-Org", "0123456789abcdef0123456789abcdef01234567", env=env)
    assert done.returncode == 0, done.stderr
    values = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert values["registry"] == "ghcr.io/my-org"
    assert values["a2"] == f"ghcr.io/my-org/verl-npu:a2-{manifest_digest()}-0123456789ab"
    assert values["a3"] == f"ghcr.io/my-org/verl-npu:a3-{manifest_digest()}-0123456789ab"
    done = run_bash(REPO / "ci/images/build.sh", "plan", "not an owner", "0123456789ab", env=env)
    assert done.returncode == 2 and "owner 'not an owner'" in done.stderr, done.stderr


def test_image_tags_per_architecture_and_registry_validation():
    from verl_npu.ci.images import ghcr_registry

    assert ghcr_registry("Verl-Project") == "ghcr.io/verl-project"
    for bad in ("", "-lead", "a b", "x" * 40, "org/repo"):
        with pytest.raises(ValueError, match="not a GitHub user or organisation name"):
            ghcr_registry(bad)
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert image_tag("a2", commit) == f"verl-npu:a2-{manifest_digest()}-0123456789ab"  # a local image name
    per_arch = image_tag("a2", commit, registry="ghcr.io/o", arch="arm64")
    assert per_arch == f"ghcr.io/o/verl-npu:a2-{manifest_digest()}-0123456789ab-arm64"
    assert TAG.match(per_arch.rpartition(":")[2])["arch"] == "arm64"
    with pytest.raises(ValueError, match="arch 'riscv64'"):
        image_tag("a2", commit, arch="riscv64")
    with pytest.raises(ValueError, match=r"registry 'GHCR\.io/Org'"):
        image_tag("a2", commit, registry="GHCR.io/Org")


def test_verl_npu_ci_image_tag_is_the_same_command_as_the_module():
    args = ["--chip", "a3", "--commit", "0123456789abcdef0123", "--owner", "Some-Org"]
    cli = subprocess.run([sys.executable, "-m", "verl_npu.cli", "ci", "image-tag", *args],
                         capture_output=True, text=True, check=False)  # fmt: skip
    module = subprocess.run([sys.executable, "-m", "verl_npu.ci.images", *args], capture_output=True, text=True,
                            check=False)  # fmt: skip
    assert cli.returncode == module.returncode == 0, cli.stderr + module.stderr
    assert cli.stdout == module.stdout == f"{image_tag('a3', '0123456789abcdef0123', registry='ghcr.io/some-org')}\n"


# --- the self-hosted runners each workflow needs, and the gate in front of them -------------------------------

# upstream verl's Ascend runner scale sets (ci/README.md): A2 with 8 NPUs, A3 with 16, and the A3 runner its
# multi-node job submits from
UPSTREAM_RUNNERS = {"linux-aarch64-a2b3-8", "linux-aarch64-a3-16", "linux-aarch64-a3-8"}
HOSTED_RUNNER = re.compile(r"(?:ubuntu|windows|macos)-[\w.-]+")
RUNNER_VARIABLES = {"ASCEND_RUNNER_GROUP": "${{ vars.ASCEND_RUNNER_GROUP }}",
                    "ASCEND_RUNNER_LABELS": "${{ vars.ASCEND_RUNNER_LABELS }}"}  # fmt: skip


def runner_labels(job: dict) -> set[str]:
    """The runner labels a job can run on, `${{ matrix.runner }}` resolved through its matrix."""
    runs_on = job.get("runs-on")
    if runs_on is None:  # a reusable workflow's call
        return set()
    labels = runs_on["labels"] if isinstance(runs_on, dict) else runs_on
    matrix = [e["runner"] for e in job.get("strategy", {}).get("matrix", {}).get("include", []) if "runner" in e]
    found = set()
    for label in [labels] if isinstance(labels, str) else labels:
        found |= set(matrix) if label == "${{ matrix.runner }}" else {label}
    return found


def needed(jobs: dict, name: str) -> set[str]:
    """Every job ``name`` waits for, directly or through others."""
    direct = jobs[name].get("needs", [])
    found = set([direct] if isinstance(direct, str) else direct)
    for other in list(found):
        found |= needed(jobs, other)
    return found


def test_self_hosted_jobs_run_on_upstreams_runners_in_the_declared_group_behind_a_gate():
    gated = set()
    for workflow in WORKFLOWS:
        jobs = load(workflow)["jobs"]
        self_hosted = {name: labels for name, job in jobs.items()
                       if (labels := {x for x in runner_labels(job) if not HOSTED_RUNNER.fullmatch(x)})}  # fmt: skip
        if not self_hosted:
            continue
        gated.add(workflow.stem)
        labels = set().union(*self_hosted.values())
        assert labels <= UPSTREAM_RUNNERS, f"{workflow.name}: no runner has {sorted(labels - UPSTREAM_RUNNERS)}"
        gate = jobs.get("runners")
        assert gate is not None, f"{workflow.name}: self-hosted jobs {sorted(self_hosted)} but no `runners` job"
        assert HOSTED_RUNNER.fullmatch(gate["runs-on"]) and gate["timeout-minutes"] <= 10
        (check,) = [step for step in gate["steps"] if "check_runners.sh" in step.get("run", "")]
        assert check["run"] == f"bash ci/nightly/check_runners.sh {workflow.stem} {' '.join(sorted(labels))}"
        assert check["env"] == RUNNER_VARIABLES
        for name in jobs.keys() - {"runners"}:  # nothing starts before the gate, no image is built for nothing
            assert "runners" in needed(jobs, name), (workflow.name, name)
        for name in self_hosted:
            assert jobs[name]["runs-on"]["group"] == "${{ vars.ASCEND_RUNNER_GROUP }}", (workflow.name, name)
    assert gated == {"nightly", "multinode"}


def test_ci_readme_names_every_runner_variable_and_secret_the_workflows_use():
    readme = (REPO / "ci/README.md").read_text()
    text = "\n".join(p.read_text() for p in WORKFLOWS)
    settings = set(re.findall(r"\b(?:vars|secrets)\.(\w+)", text)) - {"GITHUB_TOKEN"}
    assert settings >= {"ASCEND_RUNNER_GROUP", "ASCEND_RUNNER_LABELS", "ASCEND_KUBECONFIG"}
    for name in sorted(settings | UPSTREAM_RUNNERS):
        assert f"`{name}`" in readme, f"ci/README.md does not name {name}"


def check_runners(tmp_path: Path, *labels: str, **variables: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GITHUB_ACTIONS": "true", **variables}
    return run_bash(REPO / "ci/nightly/check_runners.sh", "nightly", *labels, env=env)


def test_check_runners_stops_a_repository_without_the_runners_naming_what_it_needs(tmp_path):
    labels = ("linux-aarch64-a2b3-8", "linux-aarch64-a3-16")
    done = check_runners(tmp_path, *labels)
    assert done.returncode == 1
    assert "ASCEND_RUNNER_GROUP is not set" in done.stderr
    assert "ASCEND_RUNNER_LABELS (not set) does not list linux-aarch64-a2b3-8 linux-aarch64-a3-16" in done.stderr
    assert "queue for 24 hours" in done.stderr and 'ci/README.md, "Runners, variables and secrets"' in done.stderr
    assert done.stdout.count("::error title=nightly needs Ascend runners::") == 2
    group = {"ASCEND_RUNNER_GROUP": "ascend-ci"}
    done = check_runners(tmp_path, *labels, **group, ASCEND_RUNNER_LABELS="linux-aarch64-a2b3-8")
    assert done.returncode == 1 and "ASCEND_RUNNER_GROUP" not in done.stderr.split("\n")[0]
    assert "(linux-aarch64-a2b3-8) does not list linux-aarch64-a3-16:" in done.stderr
    declared = "linux-aarch64-a3-16  linux-aarch64-a3-8 linux-aarch64-a2b3-8"  # any order, any spacing
    done = check_runners(tmp_path, *labels, **group, ASCEND_RUNNER_LABELS=declared)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "nightly: runner group 'ascend-ci' has the runner scale sets " + " ".join(labels) + "\n"
    done = check_runners(tmp_path, "linux-aarch64-a3-16", "a3;rm", ASCEND_RUNNER_GROUP="g", ASCEND_RUNNER_LABELS="x")
    assert done.returncode == 2 and "'a3;rm' is not a runner label" in done.stderr
