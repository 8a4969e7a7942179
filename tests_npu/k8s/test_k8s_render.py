"""`verl-npu k8s render` / `validate`: what the RayJob and Volcano Job carry, the refusals, the validator."""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("referencing", reason="the schema validator's reference resolver; not installed here")

import yaml
from referencing import Resource
from support.paths import REPO

from verl_npu.ci.images import image_tag, manifest_digest
from verl_npu.cli import main
from verl_npu.envfile import env_file_variables
from verl_npu.k8s import defaults, render, schemas, validate
from verl_npu.stack import load_stack

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REGISTRY = "registry.example/team"
IMAGE = image_tag("a3", COMMIT, registry=REGISTRY)
LAUNCH = "examples/glm5_2/run_glm5_2_grpo_a3.sh"
NIGHTLY_ENV = str(REPO / "ci/nightly/nightly.env")
CI_RUN_DIR = "/root/.cache/verl-npu/runs/verl-npu-mn-4242-1"  # the workflow's RUN_DIR for run 4242, attempt 1
ENV = """\
# a test cluster
MODEL_PATH=/root/.cache/models/zai-org/GLM-5.2
TRAIN_FILES=/root/.cache/datasets/glm5_2/train.parquet
CKPT_DIR=/root/.cache/checkpoints/glm5_2
NNODES=4
NPUS_PER_NODE=16
VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor
HCCL_CONNECT_TIMEOUT=7200
HCCL_BUFFSIZE=400
"""


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.env"
    path.write_text(ENV)
    return path


def rendered(
    tmp_path: Path, *args: str, kind: str = "rayjob", name: str = "verl-npu-test-1", preflight: bool = False
) -> list[dict]:
    """The documents of a render. Without ``preflight`` the render skips it (--no-preflight): the test cluster of
    ENV is 4 nodes, on which the GLM-5.2 launch is a NO-GO; the tests of what preflight decides say preflight=True."""
    out = tmp_path / f"{name}.{kind}.yaml"
    argv = ["k8s", "render", kind, "--name", name, "--launch", LAUNCH, "-o", str(out)]
    if "--image" not in args and "--commit" not in args:
        argv += ["--image", IMAGE]
    if not preflight:
        argv.append("--no-preflight")
    assert main([*argv, *args]) == 0
    return [d for d in yaml.safe_load_all(out.read_text())]


def by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def node_pods(doc: dict) -> dict[str, dict]:
    """role -> pod spec of the Ray nodes of a RayJob or a Volcano Job."""
    if doc["kind"] == "RayJob":
        cluster = doc["spec"]["rayClusterSpec"]
        pods = {"head": cluster["headGroupSpec"]["template"]}
        for group in cluster.get("workerGroupSpecs", []):  # one group: "npu"
            pods["worker"] = group["template"]
    else:
        pods = {t["name"]: t["template"] for t in doc["spec"]["tasks"]}
    return {role: template["spec"] for role, template in pods.items()}


def every_pod(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for doc in docs:
        for path, spec in validate.pod_templates(doc):
            out.append((f"{doc['kind']} {path}", spec))
    return out


def mounts(spec: dict) -> dict[str, dict]:
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in spec["containers"][0].get("volumeMounts", [])}


def container_env(spec: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in spec["containers"][0]["env"]}


# --- the CI RayJob, rendered by the command multinode.yml runs ------------------------------------


def workflow_render_argv(run_id: str, attempt: str, out: Path) -> list[str]:
    """The `verl-npu k8s render` command of multinode.yml, with the workflow's variables filled in."""
    workflow = yaml.safe_load((REPO / ".github/workflows/multinode.yml").read_text())
    job = workflow["jobs"]["rayjob"]
    script = next(s["run"] for s in job["steps"] if "k8s render" in s.get("run", ""))
    command = next(line for line in script.replace("\\\n", " ").splitlines() if "k8s render" in line)
    name = job["env"]["NAME"].replace("${{ github.run_id }}", run_id).replace("${{ github.run_attempt }}", attempt)
    run_dir = job["env"]["RUN_DIR"].replace("${{ github.run_id }}", run_id)
    run_dir = run_dir.replace("${{ github.run_attempt }}", attempt)
    values = {"NAME": name, "RUN_DIR": run_dir, "IMAGE": IMAGE, "GITHUB_SHA": COMMIT}
    words = [re.sub(r"\$(\w+)", lambda m: values[m[1]], w) for w in shlex.split(command)]
    assert words[0].endswith("verl-npu") and words[1:3] == ["k8s", "render"]
    words = words[1:]
    words[words.index("-o") + 1] = str(out)
    # the workflow runs from the checkout's root; the test from anywhere
    words[words.index("--model-config") + 1] = str(REPO / words[words.index("--model-config") + 1])
    return words


@pytest.fixture(scope="module")
def ci_docs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ci") / "rayjob.yaml"
    assert main(workflow_render_argv("4242", "1", out)) == 0
    return list(yaml.safe_load_all(out.read_text()))


def test_the_ci_rayjob_is_the_nightly_launch_on_two_a3_nodes(ci_docs):
    rayjob = by_kind(ci_docs, "RayJob")
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == load_stack().packages["ray"].version == "2.60.0"
    pods = node_pods(rayjob)
    assert set(pods) == {"head", "worker"}
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    # the head is one of the NNODES=2 nodes and has its NPUs: one worker
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    for role, spec in pods.items():
        resources = spec["containers"][0]["resources"]
        assert resources["limits"]["huawei.com/ascend-1980"] == 16, role
        assert resources["requests"]["huawei.com/ascend-1980"] == 16, role
        assert container_env(spec)["VERL_NPU_EXPECT_NPUS"] == "16"
    entry = by_kind(ci_docs, "ConfigMap")["data"]["entrypoint.sh"]
    assert rayjob["spec"]["entrypoint"] == "bash /etc/verl-npu/entrypoint.sh"
    assert entry.rstrip().endswith(
        "exec bash /opt/verl-npu/src/verl-npu/ci/nightly/run_job.sh multinode_grpo "
        "/root/.cache/verl-npu/runs/verl-npu-mn-4242-1/results"
    )
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True and rayjob["spec"]["backoffLimit"] == 0


def test_every_pod_of_the_ci_rayjob_has_shm_shared_storage_pull_secrets_and_the_image(ci_docs):
    pods = every_pod(ci_docs)
    assert {p for p, _ in pods} >= {
        "RayJob spec.rayClusterSpec.headGroupSpec.template.spec",
        "RayJob spec.rayClusterSpec.workerGroupSpecs[0].template.spec",
        "RayJob spec.submitterPodTemplate.spec",
        "Pod spec",
    }
    for where, spec in pods:
        assert spec["imagePullSecrets"] == [{"name": "verl-npu-registry"}], where
        assert {c["image"] for c in spec["containers"]} == {IMAGE}, where
    for where, spec in pods:
        if "submitter" in where:
            continue
        shared = mounts(spec)["/root/.cache"]
        assert shared["persistentVolumeClaim"] == {"claimName": "verl-npu-cache"}, where
    for spec in node_pods(by_kind(ci_docs, "RayJob")).values():
        shm = mounts(spec)["/dev/shm"]["emptyDir"]
        assert shm["medium"] == "Memory" and render.quantity(shm["sizeLimit"], "") >= 64 * 2**30
        # what the job makes on the head (small model, data) is on the shared claim, where workers read it
        assert container_env(spec)["DSA_JOB_DIR"] == "/root/.cache/verl-npu/runs/verl-npu-mn-4242-1/job"


def test_ci_names_differ_per_run_attempt_and_fit_kuberays_limit(tmp_path):
    names = []
    for attempt in ("1", "2"):
        out = tmp_path / f"{attempt}.yaml"
        argv = workflow_render_argv("98765432101", attempt, out)
        argv.insert(argv.index("--"), "--no-preflight")  # names only: preflight of this launch is the fixture's
        assert main(argv) == 0
        names.append({(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.read_text())})
    first, second = names
    assert not {n for _, n in first} & {n for _, n in second}
    rayjob_name = next(n for k, n in first if k == "RayJob")
    assert rayjob_name == "verl-npu-mn-98765432101-1"
    assert validate.DNS1035_LABEL.match(rayjob_name) and len(rayjob_name) <= 47


def test_the_env_file_reaches_every_node_but_no_interface_name_is_forced(ci_docs):
    nightly = env_file_variables(str(REPO / "ci/nightly/nightly.env"))
    config = by_kind(ci_docs, "ConfigMap")["data"]
    for spec in node_pods(by_kind(ci_docs, "RayJob")).values():
        env = container_env(spec)
        assert env["ENV_FILE"] == env["VERL_NPU_ENV_FILE"] == "/etc/verl-npu/nightly.env"
        assert {k: env[k] for k in nightly} == nightly
        assert not set(env) & set(render.PER_NODE_KEYS)
        assert mounts(spec)["/etc/verl-npu"]["configMap"]["name"] == by_kind(ci_docs, "ConfigMap")["metadata"]["name"]
    assert config["nightly.env"].startswith((REPO / "ci/nightly/nightly.env").read_text().rstrip("\n"))
    head, worker = config["head.sh"], config["worker.sh"]
    assert "/opt/verl-npu/src/verl-npu/examples/glm5_2/ray_start.sh head" in head
    assert 'examples/glm5_2/ray_start.sh worker "$head_ip"' in worker and '"$FQ_RAY_IP"' in worker


def test_the_rendered_env_file_means_the_same_to_bash_and_to_verl_npus_reader(tmp_path, env_file):
    docs = rendered(tmp_path, "--env-file", str(env_file), "--env", "EXTRA=two words", "--env", "HCCL_BUFFSIZE=800")
    text = by_kind(docs, "ConfigMap")["data"]["cluster.env"]
    copy_path = tmp_path / "copy.env"
    copy_path.write_text(text)
    ours = env_file_variables(str(copy_path))
    dump = subprocess.run(
        ["bash", "-c", 'set -a; source "$1"; set +a; env -0', "-", str(copy_path)],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    sourced = dict(item.split("=", 1) for item in dump.stdout.split("\0") if "=" in item)
    assert {k: sourced[k] for k in ours} == ours
    assert ours["EXTRA"] == "two words" and ours["HCCL_BUFFSIZE"] == "800" and ours["RAY_PORT"] == "6379"
    env = container_env(node_pods(by_kind(docs, "RayJob"))["head"])
    assert env["EXTRA"] == "two words" and env["HCCL_BUFFSIZE"] == "800"


def test_the_node_scripts_are_shellcheck_clean(tmp_path, env_file):
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    scripts = []
    for kind in render.KINDS:
        for name, text in by_kind(rendered(tmp_path, "--env-file", str(env_file), kind=kind), "ConfigMap")[
            "data"
        ].items():
            if name.endswith(".sh"):
                scripts.append(tmp_path / f"{kind}-{name}")
                scripts[-1].write_text(text)
    assert len(scripts) == 5
    done = subprocess.run([shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\necho $UNQUOTED\n")  # the check can fail
    assert subprocess.run([shellcheck, str(bad)], capture_output=True).returncode != 0


# --- the GLM-5.2 example: KubeRay and Volcano ------------------------------------------------------


def example_pvcs(env_path: Path) -> list[str]:
    """--pvc options that put the example's data paths on shared claims, as a site would mount them."""
    values = env_file_variables(str(env_path))
    roots = set()
    for key in render.SHARED_PATH_KEYS:
        if key in values:
            path = Path(values[key])
            roots.add("/root/.cache" if path.is_relative_to("/root/.cache") else f"/{path.parts[1]}")
    return [f"--pvc=shared{i}={root}" for i, root in enumerate(sorted(roots))]


@pytest.mark.parametrize("kind", render.KINDS)
def test_the_glm5_2_example_renders_from_its_env_file_and_launch(tmp_path, kind):
    env_path = REPO / "examples/glm5_2/glm5_2.env"
    example = env_file_variables(str(env_path))
    nnodes, npus = int(example["NNODES"]), int(example["NPUS_PER_NODE"])
    docs = rendered(
        tmp_path, "--env-file", str(env_path), *example_pvcs(env_path), *docs_resource_options(),
        "--", "trainer.total_training_steps=200", kind=kind, name="glm5-2-grpo-7", preflight=True,
    )  # fmt: skip
    assert validate.validate_documents(docs, "test") == []
    job = by_kind(docs, "RayJob" if kind == "rayjob" else "Job")
    pods = node_pods(job)
    if kind == "rayjob":
        (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        replicas = 1 + group["replicas"]
        assert job["spec"]["rayClusterSpec"]["rayVersion"] == load_stack().packages["ray"].version
    else:
        assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["spec"]["schedulerName"] == "volcano"
        tasks = {t["name"]: t for t in job["spec"]["tasks"]}
        assert tasks["head"]["replicas"] == 1
        assert tasks["head"]["policies"] == [{"event": "TaskCompleted", "action": "CompleteJob"}]
        replicas = sum(t["replicas"] for t in tasks.values())
        assert job["spec"]["minAvailable"] == nnodes  # gang: all 32 nodes or none
    assert replicas == nnodes == 32
    for spec in pods.values():
        limits = spec["containers"][0]["resources"]["limits"]
        assert limits["huawei.com/ascend-1980"] == npus == 16
        env = container_env(spec)
        for key in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "VERL_VLLM_ASCEND_GLM52_PATCH"):
            assert env[key] == example[key]
        assert "HCCL_SOCKET_IFNAME" not in env
        assert mounts(spec)["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert spec["imagePullSecrets"] == [{"name": "verl-npu-registry"}]
    scripts = by_kind(docs, "ConfigMap")["data"]
    launch = "exec bash /opt/verl-npu/src/verl-npu/examples/glm5_2/run_glm5_2_grpo_a3.sh"
    runs_launch = scripts["entrypoint.sh"] if kind == "rayjob" else scripts["head.sh"]
    assert runs_launch.rstrip().splitlines()[-1] == f"{launch} trainer.total_training_steps=200"
    if kind == "volcano":
        assert scripts["head.sh"].index("ray_start.sh head") < scripts["head.sh"].index(launch)
        assert "head_host=glm5-2-grpo-7-head-0.glm5-2-grpo-7" in scripts["worker.sh"]
        assert all(spec["restartPolicy"] == "Never" for spec in pods.values())
    # no deadline was asked for: nothing stops the run (a 3 h default killed a 200-step run before its first save)
    assert "activeDeadlineSeconds" not in job["spec"]
    assert all("activeDeadlineSeconds" not in spec for spec in pods.values())
    assert job["metadata"]["annotations"][render.DEADLINE_ANNOTATION].startswith("none")


# --- the GLM-5.2 command of ci/k8s/README.md: memory the nodes hold, no deadline --------------------------

# Allocatable memory that the public record shows a CCE A3 node (huawei.com/ascend-1980, 16 NPUs) holds: Huawei
# Cloud plans 60Gi per NPU die for a container on these nodes, 16 x 60Gi for a whole node (ci/k8s/README.md).
CCE_A3_MEMORY_FLOOR = 16 * 60 * 2**30


def docs_glm5_2_render(out: Path) -> list[str]:
    """The `verl-npu k8s render` command of ci/k8s/README.md's GLM-5.2 section, as `main` takes it."""
    text = (REPO / "ci/k8s/README.md").read_text()
    section = text[text.index("## GLM-5.2 on 32 A3 nodes") :]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start : section.index("```", start)]
    command = next(line for line in block.replace("\\\n", " ").splitlines() if "k8s render" in line)
    words = shlex.split(command.replace('"$(git rev-parse HEAD)"', COMMIT).replace("<owner>", "owner"))
    assert words[:3] == ["verl-npu", "k8s", "render"]
    words = words[1:]
    words[words.index("-o") + 1] = str(out)
    return words


def docs_resource_options() -> list[str]:
    """The --memory and --shm-size of the documented GLM-5.2 command."""
    words = docs_glm5_2_render(Path("x"))
    return [w for option in ("--memory", "--shm-size") for w in (option, words[words.index(option) + 1])]


def glm5_2_host_ram() -> float:
    """Preflight's host RAM estimate of the busiest node for the example (bytes), computed here as the render does."""
    from verl_npu.preflight import run_preflight

    env = env_file_variables(str(REPO / "examples/glm5_2/glm5_2.env"))
    report = run_preflight(REPO / LAUNCH, ["trainer.total_training_steps=200"], env=env, chip="a3")
    return report.memory.node_host_bytes


def test_the_documented_glm5_2_render_has_no_deadline_and_a_memory_request_the_nodes_hold(tmp_path, capsys):
    out = tmp_path / "glm5_2.rayjob.yaml"
    assert main(docs_glm5_2_render(out)) == 0
    assert main(["k8s", "validate", str(out)]) == 0
    rayjob = by_kind(list(yaml.safe_load_all(out.read_text())), "RayJob")
    assert "activeDeadlineSeconds" not in rayjob["spec"]
    assert "deadline none" in capsys.readouterr().err
    need = glm5_2_host_ram()
    for role, spec in node_pods(rayjob).items():
        resources = spec["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"], role  # Guaranteed: the request is what it may use
        memory = render.quantity(resources["requests"]["memory"], "")
        shm = render.quantity(mounts(spec)["/dev/shm"]["emptyDir"]["sizeLimit"], "")
        assert need + shm <= memory <= CCE_A3_MEMORY_FLOOR, role
    assert rayjob["metadata"]["annotations"][render.PREFLIGHT_ANNOTATION].startswith("go: ")


def test_the_glm5_2_launch_at_the_default_memory_is_refused_naming_both_numbers(tmp_path, capsys):
    out = tmp_path / "glm5_2.rayjob.yaml"
    words = docs_glm5_2_render(out)
    for option in ("--memory", "--shm-size"):
        del words[words.index(option) : words.index(option) + 2]
    assert main(words) == 1
    assert not out.exists()
    err = capsys.readouterr().err
    need = glm5_2_host_ram()
    shm = render.quantity(defaults.DEFAULT_SHM_SIZE, "")
    assert "NO-GO, nothing written" in err
    assert f"--memory {defaults.DEFAULT_MEMORY}: node " in err
    assert f"needs {need / 2**30:.1f} GiB of host RAM" in err  # preflight's estimate ...
    # ... and the pod's
    assert f"= {(need + shm) / 2**30:.1f} GiB, more than the 512.0 GiB each node pod requests" in err
    assert f"--memory {math.ceil((need + shm) / 2**30)}Gi or more" in err


def test_the_memory_request_holds_the_host_ram_estimate_and_dev_shm_together(tmp_path, capsys):
    """/dev/shm is memory-backed, so the pod's memory must hold it beside the processes' host RAM."""
    from verl_npu.preflight import run_preflight

    env = {"DSA_JOB_DIR": CI_RUN_DIR + "/job"}  # the CI render's: preflight composes the same launch once
    report = run_preflight(REPO / "ci/nightly/jobs/multinode_grpo.sh", env=env, chip="a3",
                           model_config=str(REPO / "ci/nightly/models/glm5_small"))  # fmt: skip
    need_gib = math.ceil(report.memory.node_host_bytes / 2**30)
    assert 0 < need_gib < 16
    out = tmp_path / "n.yaml"
    argv = [
        "k8s", "render", "rayjob", "--name", "n-1", "--image", IMAGE, "--env-file", NIGHTLY_ENV,
        "--nnodes", "2", "--npus-per-node", "16", "--env", f"DSA_JOB_DIR={env['DSA_JOB_DIR']}",
        "--launch", "ci/nightly/run_job.sh", "--trainer-launch", "ci/nightly/jobs/multinode_grpo.sh",
        "--model-config", str(REPO / "ci/nightly/models/glm5_small"), "--shm-size", "16Gi", "-o", str(out),
        "--", "multinode_grpo", CI_RUN_DIR + "/results",
    ]  # fmt: skip
    # the estimate alone would fit, with /dev/shm it does not
    assert main([*argv[:-3], "--memory", f"{16 + need_gib - 1}Gi", *argv[-3:]]) == 1
    assert f"--memory {16 + need_gib - 1}Gi: node " in capsys.readouterr().err and not out.exists()
    assert main([*argv[:-3], "--memory", f"{16 + need_gib}Gi", *argv[-3:]]) == 0
    assert (
        "within --memory"
        in by_kind(list(yaml.safe_load_all(out.read_text())), "RayJob")["metadata"]["annotations"][
            render.PREFLIGHT_ANNOTATION
        ]
    )


def test_a_launch_preflight_says_no_go_to_is_not_rendered_and_every_problem_is_listed(tmp_path, capsys, env_file):
    """The documented GLM-5.2 render with expandable segments, which vLLM's sleep mode refuses, and the default
    memory: both problems in one refusal."""
    out = tmp_path / "glm5_2.rayjob.yaml"
    words = docs_glm5_2_render(out)
    for option in ("--memory", "--shm-size"):
        del words[words.index(option) : words.index(option) + 2]
    words.insert(words.index("--"), "--env=PYTORCH_NPU_ALLOC_CONF=expandable_segments:True")
    assert main(words) == 1
    err = capsys.readouterr().err
    assert "preflight of examples/glm5_2/run_glm5_2_grpo_a3.sh: launch.npu-alloc-conf: PYTORCH_NPU_ALLOC_CONF" in err
    assert f"--memory {defaults.DEFAULT_MEMORY}: node " in err
    assert not out.exists()
    # asked not to preflight, the render says so in the manifest and on stderr
    docs = rendered(tmp_path, "--env-file", str(env_file))
    assert by_kind(docs, "RayJob")["metadata"]["annotations"][render.PREFLIGHT_ANNOTATION].startswith("not run")
    assert "WARNING: preflight not run (--no-preflight)" in capsys.readouterr().err


def test_a_launch_that_runs_no_trainer_is_refused_unless_its_trainer_launch_is_named(tmp_path, capsys):
    out = tmp_path / "out.yaml"
    argv = [
        "k8s", "render", "rayjob", "--name", "n-1", "--image", IMAGE, "--env-file", NIGHTLY_ENV,
        "--nnodes", "2", "--npus-per-node", "16", "--env", "DSA_JOB_DIR=/root/.cache/j", "--launch",
        "ci/nightly/run_job.sh", "-o", str(out), "--", "multinode_grpo", "/root/.cache/r",
    ]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "preflight of ci/nightly/run_job.sh: launch.no-trainer" in err and "--trainer-launch" in err
    assert "makes no host RAM estimate until the failures above are fixed: --memory unchecked" in err
    assert not out.exists()


# --- the deadline: none unless asked; from the launch's steps and a stated step time ----------------------


def test_the_deadline_is_the_startup_plus_the_launchs_steps_times_the_step_time(tmp_path, env_file, capsys):
    for kind in render.KINDS:
        docs = rendered(tmp_path, "--env-file", str(env_file), "--step-time", "900", "--results-pod",
                        "--", "trainer.total_training_steps=200", kind=kind)  # fmt: skip
        job = by_kind(docs, "RayJob" if kind == "rayjob" else "Job")
        expected = render.CLUSTER_WAIT_S + 200 * 900
        if kind == "rayjob":
            assert job["spec"]["activeDeadlineSeconds"] == expected
        else:
            assert {spec["activeDeadlineSeconds"] for spec in node_pods(job).values()} == {expected}
        assert job["metadata"]["annotations"][render.DEADLINE_ANNOTATION] == (
            f"{expected} s = 2400 s to start + 200 steps (trainer.total_training_steps of run_glm5_2_grpo_a3.sh) "
            "x 900 s (--step-time)"
        )
        assert by_kind(docs, "Pod")["spec"]["activeDeadlineSeconds"] == expected + 3600
    docs = rendered(tmp_path, "--env-file", str(env_file), "--step-time", "1.5", "--startup-time", "5400",
                    "--", "trainer.total_training_steps=3", "trainer.total_training_steps=7")  # fmt: skip
    assert by_kind(docs, "RayJob")["spec"]["activeDeadlineSeconds"] == 5400 + math.ceil(7 * 1.5)  # the last one wins
    docs = rendered(tmp_path, "--env-file", str(env_file), "--deadline", "36000", "--results-pod")
    assert by_kind(docs, "RayJob")["spec"]["activeDeadlineSeconds"] == 36000
    # without one, nothing stops the run, and the results pod ends after a week
    docs = rendered(tmp_path, "--env-file", str(env_file), "--results-pod")
    assert "activeDeadlineSeconds" not in by_kind(docs, "RayJob")["spec"]
    assert by_kind(docs, "Pod")["spec"]["activeDeadlineSeconds"] == render.RESULTS_POD_LIFETIME_S == 7 * 24 * 3600


def test_the_steps_come_from_the_trainer_launch_the_launch_runs(tmp_path, capsys):
    """The nightly's launch is run_job.sh; its trainer launch, ci/nightly/jobs/multinode_grpo.sh, sets 15 steps."""
    argv = ["--env-file", NIGHTLY_ENV, "--nnodes", "2", "--npus-per-node", "16", "--env", "DSA_JOB_DIR=/root/.cache/j",
            "--launch", "ci/nightly/run_job.sh", "--step-time", "60"]  # fmt: skip
    docs = rendered(tmp_path, *argv, "--trainer-launch", "ci/nightly/jobs/multinode_grpo.sh", "--", "multinode_grpo")
    assert by_kind(docs, "RayJob")["spec"]["activeDeadlineSeconds"] == render.CLUSTER_WAIT_S + 15 * 60
    out = tmp_path / "none.yaml"
    base = ["k8s", "render", "rayjob", "--name", "n-1", "--image", IMAGE, "--no-preflight", "-o", str(out)]
    assert main([*base, *argv, "--", "multinode_grpo"]) == 2
    assert "--step-time: no command in" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--step-time", "900"], r"--step-time: .*run_glm5_2_grpo_a3\.sh sets no trainer\.total_training_steps"),
        (["--step-time", "900", "--", "~trainer.total_training_steps"], r"sets no trainer\.total_training_steps"),
        (
            ["--step-time", "900", "--", "trainer.total_training_steps=many"],
            r"trainer\.total_training_steps='many': expected an integer from 1",
        ),
        (["--step-time", "900", "--deadline", "600"], r"--deadline and --step-time both set the run's deadline"),
        (["--startup-time", "60"], r"--startup-time counts only with --step-time"),
        (["--step-time", "0"], r"--step-time='0': expected a finite number > 0 and <= 604800"),
        (["--step-time", "nan"], r"--step-time='nan': expected a finite number"),
        (["--deadline", "0"], r"--deadline=0: expected an integer from 1 to 31622400"),
        (["--deadline", "1e9"], r"--deadline='1e9': expected an integer"),
        (["--ttl", "99999999"], r"--ttl=99999999: expected an integer from 1 to 2592000"),
        (["--step-time", "604800", "--", "trainer.total_training_steps=1000"], r"exceeds 31622400 s \(366 days\)"),
    ],
)
def test_deadline_options_are_range_checked(tmp_path, capsys, argv, expected):
    assert re.search(expected, refused(tmp_path, capsys, ["--no-preflight", *argv]))


# --- requests and limits of the CCE A3 nodes -------------------------------------------------------------


def test_the_node_pods_request_what_upstream_ci_requests_of_the_same_nodes(ci_docs):
    """512Gi and 64 CPUs, as upstream verl's multi-node RayJob on CCE A3 nodes (ci/k8s/README.md); requests =
    limits; the default /dev/shm inside that memory."""
    for role, spec in node_pods(by_kind(ci_docs, "RayJob")).items():
        resources = spec["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"] == {
            "huawei.com/ascend-1980": 16, "cpu": "64", "memory": "512Gi",
        }, role  # fmt: skip
        assert mounts(spec)["/dev/shm"]["emptyDir"]["sizeLimit"] == "128Gi"
    assert (defaults.DEFAULT_CPU, defaults.DEFAULT_MEMORY) == ("64", "512Gi")
    rayjob = by_kind(ci_docs, "RayJob")
    assert rayjob["spec"]["activeDeadlineSeconds"] == 10800  # the workflow's --deadline, within its 4 h timeout
    assert rayjob["metadata"]["annotations"][render.PREFLIGHT_ANNOTATION].startswith("go: node ")


def test_cpu_memory_and_shm_are_options_range_checked_all_at_once(tmp_path, capsys, env_file):
    docs = rendered(tmp_path, "--env-file", str(env_file), "--cpu", "125", "--memory", "900Gi", "--shm-size", "64Gi")
    head = node_pods(by_kind(docs, "RayJob"))["head"]
    assert head["containers"][0]["resources"]["limits"] == {
        "huawei.com/ascend-1980": 16,
        "cpu": "125",
        "memory": "900Gi",
    }
    assert mounts(head)["/dev/shm"]["emptyDir"]["sizeLimit"] == "64Gi"
    err = refused(tmp_path, capsys, ["--cpu", "0", "--memory", "2Pi", "--shm-size", "lots", "--ttl", "0"])
    assert err.count("expected") == 4, err  # every bad option in one message
    for expected in (
        "--cpu='0': expected a Kubernetes quantity (such as 512Gi, 64 or 500m) from 1 to 4096",
        "--memory='2Pi': expected a Kubernetes quantity (such as 512Gi, 64 or 500m) from 1Gi to 1Pi",
        "--shm-size='lots': expected a Kubernetes quantity",
        "--ttl=0: expected an integer from 1 to 2592000",
    ):
        assert expected in err
    assert "--cpu='500m': expected" in refused(tmp_path, capsys, ["--cpu", "500m"])
    assert "--memory=' 512Gi': expected" in refused(tmp_path, capsys, ["--memory", " 512Gi"])


# --- the host side of the NPUs ---------------------------------------------------------------------------


def host_mounts(spec: dict) -> dict[str, tuple[str, bool]]:
    """mount path -> (hostPath type, read-only) of a pod's host mounts."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {
        m["mountPath"]: (volumes[m["name"]]["hostPath"].get("type", ""), m.get("readOnly", False))
        for m in spec["containers"][0]["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }


def test_the_host_paths_are_the_ascend_docker_runtimes_typed_and_read_only(ci_docs):
    """npu-smi at /usr/local/bin (the Ascend Docker Runtime's default mount list), each mount typed so a node without
    it fails the pod's start instead of getting an empty directory where npu-smi should be."""
    for role, spec in node_pods(by_kind(ci_docs, "RayJob")).items():
        assert host_mounts(spec) == {
            "/usr/local/Ascend/driver": ("Directory", True),
            "/usr/local/dcmi": ("Directory", True),
            "/usr/local/bin/npu-smi": ("File", True),
        }, role


def test_host_files_and_directories_replace_their_own_defaults(tmp_path, capsys, env_file):
    docs = rendered(tmp_path, "--env-file", str(env_file), "--host-file", "/usr/local/sbin/npu-smi")
    assert host_mounts(node_pods(by_kind(docs, "RayJob"))["head"]) == {
        "/usr/local/Ascend/driver": ("Directory", True),
        "/usr/local/dcmi": ("Directory", True),
        "/usr/local/sbin/npu-smi": ("File", True),
    }
    docs = rendered(tmp_path, "--env-file", str(env_file), "--host-path", "/usr/local/Ascend/driver/tools")
    assert host_mounts(node_pods(by_kind(docs, "RayJob"))["worker"]) == {
        "/usr/local/Ascend/driver/tools": ("Directory", True),
        "/usr/local/bin/npu-smi": ("File", True),
    }
    docs = rendered(tmp_path, "--env-file", str(env_file), "--no-host-paths", kind="volcano")
    assert all(host_mounts(spec) == {} for spec in node_pods(by_kind(docs, "Job")).values())
    assert "--host-file 'npu-smi': give an absolute" in refused(tmp_path, capsys, ["--host-file", "npu-smi"])


def test_launch_arguments_and_other_chips_devices_and_claims_are_rendered(tmp_path, env_file):
    a2_env = tmp_path / "a2.env"
    a2_env.write_text(ENV.replace("NPUS_PER_NODE=16", "NPUS_PER_NODE=8"))
    image = image_tag("a2", COMMIT, registry=REGISTRY)
    docs = rendered(
        tmp_path, "--env-file", str(a2_env), "--image", image, "--chip", "a2", "--npu-resource", "huawei.com/Ascend910",
        "--pvc", "models=/root/.cache", "--pvc", "scratch=/scratch", "--pull-secret", "a", "--pull-secret", "b",
        "--no-host-paths", "--", "trainer.total_training_steps=3", "data.x='a b'",
    )  # fmt: skip
    head = node_pods(by_kind(docs, "RayJob"))["head"]
    assert head["containers"][0]["resources"]["limits"]["huawei.com/Ascend910"] == 8
    assert mounts(head)["/scratch"]["persistentVolumeClaim"] == {"claimName": "scratch"}
    assert not any("hostPath" in v for v in head["volumes"])
    assert head["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]
    entry = by_kind(docs, "ConfigMap")["data"]["entrypoint.sh"]
    assert entry.rstrip().endswith("run_glm5_2_grpo_a3.sh trainer.total_training_steps=3 'data.x='\"'\"'a b'\"'\"''")


def test_one_node_has_no_workers_and_the_shape_can_come_from_flags(tmp_path):
    one = tmp_path / "one.env"
    one.write_text(ENV.replace("NNODES=4\n", "").replace("NPUS_PER_NODE=16\n", ""))
    docs = rendered(tmp_path, "--env-file", str(one), "--nnodes", "1", "--npus-per-node", "16")
    assert "workerGroupSpecs" not in by_kind(docs, "RayJob")["spec"]["rayClusterSpec"]
    docs = rendered(tmp_path, "--env-file", str(one), "--nnodes", "1", "--npus-per-node", "16", kind="volcano")
    assert [t["name"] for t in by_kind(docs, "Job")["spec"]["tasks"]] == ["head"]
    assert "NNODES=1\nNPUS_PER_NODE=16\nRAY_PORT=6379\n" in by_kind(docs, "ConfigMap")["data"]["one.env"]


def test_ray_version_and_image_follow_the_manifest(tmp_path, env_file):
    manifest = tmp_path / "stack.toml"
    manifest.write_text(
        (REPO / "verl_npu/stack/stack.toml")
        .read_text()
        .replace('[packages.ray]\nversion = "2.60.0"', '[packages.ray]\nversion = "2.61.0"')
    )
    docs = rendered(tmp_path, "--env-file", str(env_file), "--commit", COMMIT, "--registry", REGISTRY)
    assert by_kind(docs, "RayJob")["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
    out = tmp_path / "other.yaml"
    argv = ["--manifest", str(manifest), "k8s", "render", "rayjob", "--name", "n", "--launch", LAUNCH, "--no-preflight"]
    assert main([*argv, "--env-file", str(env_file), "--commit", COMMIT, "--registry", REGISTRY, "-o", str(out)]) == 0
    (rayjob,) = [d for d in yaml.safe_load_all(out.read_text()) if d["kind"] == "RayJob"]
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == "2.61.0"
    head = node_pods(rayjob)["head"]["containers"][0]
    assert head["image"] == f"{REGISTRY}/verl-npu:a3-{manifest_digest(manifest)}-{COMMIT[:12]}"


def test_the_registry_defaults_to_the_repository_owner_on_github(tmp_path, env_file, monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY_OWNER", "Some-Org")
    docs = rendered(tmp_path, "--env-file", str(env_file), "--commit", COMMIT)
    assert node_pods(by_kind(docs, "RayJob"))["head"]["containers"][0]["image"].startswith(
        "ghcr.io/some-org/verl-npu:a3-"
    )


# --- refusals: exit 2, a named error, nothing written ---------------------------------------------


def refused(tmp_path: Path, capsys, argv: list[str], *, env_text: str | None = ENV) -> str:
    out = tmp_path / "out.yaml"
    out.write_text("previous\n")
    env_path = tmp_path / "bad.env"
    if env_text is not None:
        env_path.write_text(env_text)
    base = ["k8s", "render", "rayjob", "--name", "verl-npu-test-1", "--launch", LAUNCH, "--env-file", str(env_path)]
    if not any(a in argv for a in ("--image", "--commit")):
        base += ["--image", IMAGE]
    code = main([*base, "-o", str(out), *argv])
    assert code == 2
    assert out.read_text() == "previous\n"  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.yaml")] == []
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("env_text", "argv", "expected"),
    [
        (ENV.replace("NNODES=4\n", ""), [], r"bad\.env: NNODES is missing: set it in the env file or pass --nnodes"),
        (ENV.replace("NNODES=4", "NNODES=four"), [], r"NNODES='four' is not a positive integer"),
        (ENV.replace("NNODES=4", "NNODES=0"), [], r"NNODES='0' is not a positive integer"),
        (ENV, ["--nnodes", "8"], r"--nnodes 8 contradicts NNODES=4 in .*bad\.env"),
        (ENV.replace("NPUS_PER_NODE=16", "NPUS_PER_NODE=32"), [], r"NPUS_PER_NODE=32 .*an A3 node has 16 NPUs"),
        (ENV, ["--chip", "a9"], r"--chip 'a9': the stack manifest has a2, a3"),
        (ENV + "HCCL_SOCKET_IFNAME=eth0\n", [], r"HCCL_SOCKET_IFNAME would force one value on every node"),
        (ENV, ["--env", "GLOO_SOCKET_IFNAME=eth0"], r"--env: GLOO_SOCKET_IFNAME would force one value"),
        (ENV.replace("/root/.cache/models/", "/tmp/models/"), [], r"MODEL_PATH='/tmp/models/.*' is not on the shared"),
        (ENV, ["--env", "DSA_JOB_DIR=/tmp/job"], r"DSA_JOB_DIR='/tmp/job' is not on the shared storage"),
        (ENV, ["--shm-size", "512Mi"], r"--shm-size='512Mi': expected a Kubernetes quantity .* from 1Gi to 1Pi"),
        (ENV, ["--shm-size", "2Ti"], r"--shm-size 2Ti leaves nothing of --memory 512Gi for the node's processes"),
        (ENV, ["--memory", "lots"], r"--memory='lots': expected a Kubernetes quantity \(such as 512Gi"),
        (ENV, ["--pull-secret", "Bad_Name"], r"--pull-secret 'Bad_Name': not a valid Secret name"),
        (ENV, ["--pvc", "c=relative"], r"--pvc c=relative: the mount path must be an absolute"),
        (ENV, ["--npu-resource", "npu"], r"--npu-resource 'npu': expected a device plugin resource"),
        (ENV, ["--launch", "/etc/hostname"], r"--launch /etc/hostname: not inside the repository"),
        (ENV, ["--launch", "examples/glm5_2/missing.sh"], r"--launch examples/glm5_2/missing.sh: no such file"),
        (None, [], r"--env-file .*bad\.env: no such file"),
        ("NOT A LINE\n", [], r"bad\.env:1: expected NAME=VALUE"),
    ],
)
def test_render_refuses_bad_inputs_naming_them(tmp_path, capsys, env_text, argv, expected):
    assert re.search(expected, refused(tmp_path, capsys, argv, env_text=env_text))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--image", IMAGE.rsplit(":", 1)[0] + ":latest"],
            r"expected REGISTRY/verl-npu:<chip>-<manifest sha>-<commit>",
        ),
        (["--image", image_tag("a2", COMMIT, registry=REGISTRY)], r"is built for chip 'a2' but --chip is 'a3'"),
        (["--image", IMAGE.replace(f"-{manifest_digest()}-", "-000000000000-")], r"built from another stack manifest"),
        (["--image", IMAGE, "--commit", COMMIT], r"--image names the whole image"),
        (["--commit", "HEAD", "--registry", REGISTRY], r"commit 'HEAD': give a git sha"),
        (
            ["--commit", COMMIT, "--registry", "Registry.Example"],
            r"--registry 'Registry.Example': expected a lowercase",
        ),
        (["--name", "Verl_NPU"], r"--name 'Verl_NPU': must be a DNS-1035 label"),
        (["--name", "verl-npu-multinode-" + "9" * 30], r"of at most 47 characters"),
    ],
)
def test_render_refuses_bad_images_and_names(tmp_path, capsys, monkeypatch, argv, expected):
    monkeypatch.delenv("GITHUB_REPOSITORY_OWNER", raising=False)
    assert re.search(expected, refused(tmp_path, capsys, argv))


def test_argument_types_are_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["k8s", "render", "rayjob", "--name", "n", "--launch", LAUNCH, "--env-file", "x", "--nnodes", "0"])
    assert exc.value.code == 2
    assert "argument --nnodes: --nnodes=0: expected an integer from 1 to 1048576" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["k8s", "render", "rayjob", "--name", "n", "--launch", LAUNCH, "--env-file", "x", "--pvc", "nomount"])
    assert "expected CLAIM=MOUNT" in capsys.readouterr().err


def test_commit_without_registry_outside_github_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GITHUB_REPOSITORY_OWNER", raising=False)
    assert "--registry is required with --commit" in refused(tmp_path, capsys, ["--commit", COMMIT])


# --- the validator ---------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path, env_file) -> list[dict]:
    return rendered(tmp_path, "--env-file", str(env_file), "--results-pod")


def problems_of(docs: list[dict]) -> list[str]:
    return [str(p) for p in validate.validate_documents(docs, "m.yaml")]


HEAD = "spec.rayClusterSpec.headGroupSpec.template.spec"


def test_rendered_manifests_validate_and_broken_ones_are_rejected_with_their_path(good):
    assert problems_of(good) == []
    cases = []
    broken = copy.deepcopy(good)
    by_kind(broken, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"] = ["16"]
    cases.append((broken, f"{HEAD}.containers[0].resources.limits: ['16'] is not of type 'object'"))
    broken = copy.deepcopy(good)
    del node_pods(by_kind(broken, "RayJob"))["worker"]["containers"][0]["image"]
    cases.append((broken, "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].image: required"))
    broken = copy.deepcopy(good)
    head = node_pods(by_kind(broken, "RayJob"))["head"]["containers"][0]
    head["volumeMount"] = head.pop("volumeMounts")
    cases.append(
        (broken, f"{HEAD}.containers[0]: Additional properties are not allowed ('volumeMount' was unexpected)")
    )
    broken = copy.deepcopy(good)
    node_pods(by_kind(broken, "RayJob"))["head"]["containers"][0]["volumeMounts"][0]["name"] = "gone"
    cases.append((broken, f"{HEAD}.containers[0].volumeMounts[0].name: 'gone' is not a volume of this pod"))
    broken = copy.deepcopy(good)
    node_pods(by_kind(broken, "RayJob"))["head"]["containers"][0]["resources"]["requests"]["huawei.com/ascend-1980"] = 8
    cases.append((broken, f"{HEAD}.containers[0].resources.requests.huawei.com/ascend-1980: 8 differs from the limit"))
    broken = copy.deepcopy(good)
    node_pods(by_kind(broken, "RayJob"))["head"]["volumes"][0]["emptyDir"]["sizeLimit"] = "lots"
    cases.append((broken, f"{HEAD}.volumes[0].emptyDir.sizeLimit: 'lots' does not match the format of a Kubernetes"))
    broken = copy.deepcopy(good)
    by_kind(broken, "RayJob")["metadata"]["name"] = "x" * 48
    cases.append((broken, "metadata.name: 'xxxx"))
    broken = copy.deepcopy(good)
    by_kind(broken, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "3"
    cases.append((broken, "spec.rayClusterSpec.workerGroupSpecs[0].replicas: '3' is not of type 'integer'"))
    broken = copy.deepcopy(good)
    by_kind(broken, "Pod")["spec"]["containers"][0]["command"] = "sleep 5"
    cases.append((broken, "Pod verl-npu-test-1-results: spec.containers[0].command: 'sleep 5' is not of type 'array'"))
    broken = copy.deepcopy(good)
    by_kind(broken, "ConfigMap")["data"]["bad key"] = "x"
    cases.append((broken, "data.bad key: a ConfigMap key may hold only"))
    for docs, expected in cases:
        found = problems_of(docs)
        assert any(expected in p for p in found), (expected, found)


def test_the_volcano_job_schema_rejects_what_volcano_would(tmp_path, env_file):
    docs = rendered(tmp_path, "--env-file", str(env_file), kind="volcano")
    assert problems_of(docs) == []
    job = by_kind(docs, "Job")
    job["spec"]["policies"][0]["event"] = "PodExploded"
    job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["env"][0]["value"] = 5
    found = problems_of(docs)
    assert any("spec.policies[0].event: 'PodExploded' is not one of" in p for p in found), found
    assert any("spec.tasks[0].template.spec.containers[0].env[0].value: 5 is not of type 'string'" in p for p in found)


def test_validate_cli_exit_codes(tmp_path, good, capsys):
    ok = tmp_path / "ok.yaml"
    ok.write_text(render.dump(good))
    assert main(["k8s", "validate", str(ok)]) == 0
    del node_pods(by_kind(good, "RayJob"))["head"]["containers"][0]["image"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(good))
    assert main(["k8s", "validate", str(bad)]) == 1
    assert f"bad.yaml #2 RayJob verl-npu-test-1: {HEAD}.containers[0].image: required" in capsys.readouterr().err
    for text, expected in (
        ("a: [", "not valid YAML"),
        ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n", "apiVersion 'apps/v1' kind 'Deployment'"),
        ("", "no Kubernetes documents"),
    ):
        bad.write_text(text)
        assert main(["k8s", "validate", str(bad)]) == 2
        assert expected in capsys.readouterr().err
    assert main(["k8s", "validate", str(tmp_path / "missing.yaml")]) == 2


def ray_cluster(docs: list[dict]) -> dict:
    return by_kind(docs, "RayJob")["spec"]["rayClusterSpec"]


def head_container(docs: list[dict]) -> dict:
    return node_pods(by_kind(docs, "RayJob"))["head"]["containers"][0]


def misspell_worker_groups(docs):
    ray_cluster(docs)["workerGroupSpec"] = ray_cluster(docs).pop("workerGroupSpecs")


@pytest.mark.parametrize(
    ("breaks", "expected"),
    [
        pytest.param(
            misspell_worker_groups,
            "spec.rayClusterSpec: Additional properties are not allowed ('workerGroupSpec' was unexpected)",
            id="misspelled-crd-field",
        ),
        pytest.param(
            lambda docs: ray_cluster(docs)["workerGroupSpecs"][0].update(replicas="2"),
            "spec.rayClusterSpec.workerGroupSpecs[0].replicas: '2' is not of type 'integer'",
            id="wrong-type",
        ),
        pytest.param(
            lambda docs: ray_cluster(docs)["headGroupSpec"].pop("template"),
            "spec.rayClusterSpec.headGroupSpec: 'template' is a required property",
            id="missing-required",
        ),
        pytest.param(
            lambda docs: by_kind(docs, "RayJob")["spec"].update(submissionMode="JobMode"),
            "spec.submissionMode: 'JobMode' is not one of ['K8sJobMode'",
            id="enum",
        ),
        pytest.param(
            lambda docs: by_kind(docs, "RayJob")["spec"].update(backoffLimit=-1),
            "spec.backoffLimit: -1 is less than the minimum of 0",
            id="integer-minimum",
        ),
        pytest.param(
            lambda docs: ray_cluster(docs)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
            "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'",
            id="ray-start-params-are-strings",
        ),
        pytest.param(
            lambda docs: head_container(docs).update(imagePullPolicy="Sometimes"),
            f"{HEAD}.containers[0].imagePullPolicy: 'Sometimes' is not one of ['Always', 'IfNotPresent', 'Never'",
            id="pod-template-enum",
        ),
        pytest.param(
            lambda docs: head_container(docs)["resources"].update(limits=["16"]),
            f"{HEAD}.containers[0].resources.limits: ['16'] is not of type 'object'",
            id="pod-template-type",
        ),
        pytest.param(
            lambda docs: by_kind(docs, "RayJob")["spec"]["submitterPodTemplate"]["spec"].update(restartPolicy="Once"),
            "spec.submitterPodTemplate.spec.restartPolicy: 'Once' is not one of ['Always', 'OnFailure', 'Never'",
            id="submitter-template",
        ),
        pytest.param(
            lambda docs: node_pods(by_kind(docs, "RayJob"))["worker"].update(hostNetworking=True),
            "spec.rayClusterSpec.workerGroupSpecs[0].template.spec: Additional properties are not allowed "
            "('hostNetworking' was unexpected)",
            id="worker-template-unknown-field",
        ),
        pytest.param(
            lambda docs: head_container(docs)["resources"]["limits"].update(cpu="lots"),
            f"{HEAD}.containers[0].resources.limits.cpu: 'lots' does not match the format of a Kubernetes quantity",
            id="quantity",
        ),
        pytest.param(
            lambda docs: ray_cluster(docs)["workerGroupSpecs"][0].update(minReplicas=5),
            "spec.rayClusterSpec.workerGroupSpecs[0].minReplicas: 5 exceeds maxReplicas 3",
            id="replica-bounds",
        ),
        pytest.param(
            lambda docs: ray_cluster(docs)["workerGroupSpecs"].append(ray_cluster(docs)["workerGroupSpecs"][0]),
            "spec.rayClusterSpec.workerGroupSpecs: worker group name 'npu' is used twice",
            id="group-names",
        ),
        pytest.param(
            lambda docs: by_kind(docs, "ConfigMap").update(immutable="yes"),
            "ConfigMap verl-npu-test-1-config: immutable: 'yes' is not of type 'boolean'",
            id="configmap",
        ),
        pytest.param(
            lambda docs: by_kind(docs, "Pod")["spec"].update(containers="results"),
            "Pod verl-npu-test-1-results: spec.containers: 'results' is not of type 'array'",
            id="pod",
        ),
    ],
)
def test_the_rayjob_and_its_pod_templates_are_checked_against_the_schemas(tmp_path, env_file, breaks, expected):
    docs = rendered(tmp_path, "--env-file", str(env_file), "--results-pod")
    assert problems_of(docs) == []
    breaks(docs)
    found = problems_of(docs)
    assert any(expected in p for p in found), (expected, found)


@pytest.mark.parametrize(
    ("breaks", "expected"),
    [
        pytest.param(
            lambda job: job["spec"]["tasks"][1].update(replica=2),
            "spec.tasks[1]: Additional properties are not allowed ('replica' was unexpected)",
            id="misspelled-task-field",
        ),
        pytest.param(
            lambda job: job["spec"].update(minAvailable="4"),
            "spec.minAvailable: '4' is not of type 'integer'",
            id="wrong-type",
        ),
        pytest.param(
            lambda job: job["spec"]["tasks"][0].pop("template"),
            "spec.tasks[0]: 'template' is a required property",
            id="missing-template",
        ),
        pytest.param(
            lambda job: node_pods(job)["head"]["containers"][0].update(imagePullPolicy="Sometimes"),
            "spec.tasks[0].template.spec.containers[0].imagePullPolicy: 'Sometimes' is not one of",
            id="pod-template",
        ),
        pytest.param(
            lambda job: job["spec"]["plugins"].update(svc="--publish-not-ready-addresses"),
            "spec.plugins.svc: '--publish-not-ready-addresses' is not of type 'array'",
            id="plugins-are-lists",
        ),
        pytest.param(
            lambda job: job["spec"]["policies"][0].update(action="Explode"),
            "spec.policies[0].action: 'Explode' is not one of",
            id="action",
        ),
        pytest.param(
            lambda job: job["spec"].update(minAvailable=5),
            "spec.minAvailable: 5 exceeds the 4 pods of the job's tasks",
            id="gang-larger-than-job",
        ),
        pytest.param(
            lambda job: job["spec"]["tasks"][1].update(name="head"),
            "spec.tasks: task name 'head' is used twice",
            id="task-names",
        ),
    ],
)
def test_the_volcano_job_is_checked_against_the_schemas(tmp_path, env_file, breaks, expected):
    docs = rendered(tmp_path, "--env-file", str(env_file), kind="volcano")
    assert problems_of(docs) == []
    breaks(by_kind(docs, "Job"))
    found = problems_of(docs)
    assert any(expected in p for p in found), (expected, found)


@pytest.fixture
def fresh_schemas():
    """Schemas loaded anew in the test (and again after it)."""
    caches = (schemas.core_definitions, schemas.registry, validate._validator)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_validate_exits_2_when_the_kubernetes_release_is_missing(tmp_path, good, capsys, monkeypatch, fresh_schemas):
    ok = tmp_path / "ok.yaml"
    ok.write_text(render.dump(good))
    monkeypatch.setattr(schemas, "KUBERNETES_VERSION", "0.1")
    assert main(["k8s", "validate", str(ok)]) == 2
    err = capsys.readouterr().err
    assert "has no readable v0.1.0-local-strict schemas" in err and "bash install.sh --dev" in err


def test_render_exits_2_without_kubernetes_validate(tmp_path, env_file, capsys, monkeypatch, fresh_schemas):
    files = schemas.resources.files

    def without_kubernetes_validate(package):
        if package == "kubernetes_validate":
            raise ModuleNotFoundError(package)
        return files(package)

    monkeypatch.setattr(schemas.resources, "files", without_kubernetes_validate)
    out = tmp_path / "out.yaml"
    argv = ["k8s", "render", "rayjob", "--name", "n-1", "--launch", LAUNCH, "--env-file", str(env_file)]
    assert main([*argv, "--image", IMAGE, "--no-preflight", "-o", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "cannot validate the manifests: the Kubernetes schemas come from the kubernetes-validate package" in err
    assert "bash install.sh --dev" in err


# --- where the schemas come from (schemas/README.md) -----------------------------------------------


SCHEMA_DIR = REPO / "verl_npu/k8s/schemas"


def walk(node, path=""):
    """(path, sub-schema) of every schema object in ``node``."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}/{i}")


def test_core_types_come_from_the_pinned_kubernetes_validate_and_kubernetes_release():
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert f"kubernetes-validate=={schemas.KUBERNETES_VALIDATE_VERSION}" in dev
    assert metadata.version("kubernetes-validate") == schemas.KUBERNETES_VALIDATE_VERSION
    assert re.fullmatch(r"1\.\d+", schemas.KUBERNETES_VERSION)
    definitions = schemas.core_definitions()
    assert definitions["$id"] == schemas.DEFINITIONS_URI
    defs = definitions["$defs"]
    pod_spec = defs["io.k8s.api.core.v1.PodSpec"]
    assert pod_spec["additionalProperties"] is False  # the strict variant
    assert defs["io.k8s.api.core.v1.PodTemplateSpec"]["properties"]["spec"]["$ref"].endswith("core.v1.PodSpec")
    for (name, field), values in schemas.CORE_ENUMS.items():
        assert defs[name]["properties"][field]["enum"] == [*values, None]
    readme = (SCHEMA_DIR / "README.md").read_text()
    assert f"kubernetes-validate=={schemas.KUBERNETES_VALIDATE_VERSION}" in readme
    assert f"Kubernetes {schemas.KUBERNETES_VERSION}" in readme


@pytest.mark.parametrize("quantity", ["16", "500m", "256Gi", "1.5", ".5", "1e3", "1E-3", "+2k", "100u", "2Ei", 16, 0.5])
def test_quantities_the_api_server_accepts_validate(tmp_path, quantity):
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "q"},
        "spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"memory": quantity}}}]},
    }  # fmt: skip
    assert validate.validate_documents([pod], "q.yaml") == []
    pod["spec"]["containers"][0]["resources"]["limits"]["memory"] = "16 Gi"
    assert validate.validate_documents([pod], "q.yaml")


def test_the_crd_schemas_are_ours_closed_typed_and_referring_to_kubernetes_pod_templates():
    files = sorted(p.name for p in SCHEMA_DIR.iterdir() if p.is_file() and p.name != "__init__.py")
    # nothing fetched from upstream repositories: our two schema files and the README, no extractor
    assert files == sorted(["README.md", *schemas.CRD_SCHEMAS.values()])
    readme = (SCHEMA_DIR / "README.md").read_text()
    for (api_version, kind), name in schemas.CRD_SCHEMAS.items():
        schema = schemas.crd_schema(name)
        assert schema["$id"].startswith("urn:verl-npu:k8s:") and f"`{name}`" in readme
        assert schema["properties"]["apiVersion"] == {"const": api_version}
        assert schema["properties"]["kind"] == {"const": kind}
        assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(schema)
        refs = set()
        for where, node in walk(schema):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, where  # a misspelled field is an error
            if node.get("type") == "integer":
                assert "minimum" in node, where
            if "$ref" in node:
                refs.add(node["$ref"])
        external = {r for r in refs if not r.startswith("#/")}
        assert schemas.POD_TEMPLATE_REF in external
        assert all(r.startswith(schemas.DEFINITIONS_URI + "#/$defs/") for r in external)
        resolver = (Resource.from_contents(schema) @ schemas.registry()).resolver(base_uri=schema["$id"])
        for ref in refs:  # every reference resolves
            assert resolver.lookup(ref).contents, ref
        validate._validator(api_version, kind)  # a valid JSON Schema


def test_the_schema_files_ship_in_the_wheel_and_load_from_the_installed_package(tmp_path, env_file):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "verl_npu", source / "verl_npu", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("verl_npu-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name in schemas.CRD_SCHEMAS.values():
            assert f"verl_npu/k8s/schemas/{name}" in names
        archive.extractall(tmp_path / "site")
    check = (
        "import verl_npu, yaml\n"
        "from verl_npu.k8s import validate\n"
        "assert verl_npu.__file__.startswith(%r), verl_npu.__file__\n"
        "docs = list(yaml.safe_load_all(open(%r)))\n"
        "assert validate.validate_documents(docs, 'm') == []\n"
        "docs[1]['spec']['rayClusterSpec']['workerGroupSpec'] = []\n"
        "assert validate.validate_documents(docs, 'm')\n"
    )
    manifest = tmp_path / "m.yaml"
    manifest.write_text(render.dump(rendered(tmp_path, "--env-file", str(env_file))))
    done = subprocess.run(
        [sys.executable, "-c", check % (str(tmp_path / "site"), str(manifest))],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("chip", ["a2", "a3"])
def test_the_image_paths_the_pods_use_are_where_the_dockerfiles_put_them(chip):
    dockerfile = (REPO / f"docker/Dockerfile.{chip}").read_text()
    assert f"COPY . {render.IMAGE_SOURCE}\n" in dockerfile
    assert f'ENTRYPOINT ["{render.IMAGE_ENTRYPOINT}"]' in dockerfile
    assert (REPO / render.IMAGE_ENTRYPOINT.relative_to(render.IMAGE_SOURCE)).is_file()
