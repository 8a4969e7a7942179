"""Render a multi-node verl launch as Kubernetes objects: a KubeRay RayJob or a Volcano Job.

One env file and one launch script describe the cluster, as for a bare-metal run
(examples/glm5_2: glm5_2.env, ray_start.sh, run_glm5_2_grpo_a3.sh). The renderer turns them into:

- a ConfigMap holding the env file (plus the cluster shape ray_start.sh reads, when the file leaves
  it to flags) and the node scripts, mounted at /etc/verl-npu on every pod: the pods read the env
  file that was rendered, not the image's copy, which a site edits (paths, shape) without rebuilding;
- a head pod and NNODES-1 worker pods, each a whole node's NPUs. The head has NPUs too: NNODES
  counts the head as in ray_start.sh and verl's trainer.nnodes, and the head runs the launch,
  `verl-npu doctor` and the driver's `import verl`, which need an NPU node's devices and driver;
- every pod runs ray_start.sh (head, or worker with the head's IP) through the image's entrypoint
  (CANN's environment), so each node picks its own network interface: nothing per node is set here;
- /dev/shm as a memory-backed emptyDir with a size limit (the container default is 64 MiB, on which
  `verl-npu doctor` fails and Ray's object store falls back to disk);
- shared storage: ReadWriteMany PVCs mounted at the same path on every pod (models, data,
  checkpoints and results: the launch writes on the head what workers read);
- the image of the chip built from the stack manifest and a commit (verl_npu.ci.images), never a
  floating tag, with image pull secrets;
- per pod, requests = limits of CPU and memory that the nodes can hold (defaults.py), no deadline unless one is
  asked for (--deadline, or --step-time times the launch's trainer.total_training_steps), and the host side of
  the NPUs as typed hostPath mounts.

Before anything is written, preflight (verl_npu.preflight) checks the trainer launch the pods will run with the
env file they will read: a NO-GO, or a busiest node whose host RAM estimate plus /dev/shm exceeds the memory
request, refuses the render (LaunchRefused, exit 1) naming the numbers.

For KubeRay the head's container only starts Ray; the RayJob's entrypoint waits until the head's
ray_start.sh has seen every NPU and passed its HCCL smoke test, then runs the launch. For Volcano
(gang-scheduled: all NNODES pods or none) the head runs the launch itself after ray_start.sh, and
the job completes with the head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from verl_npu import atomic, inputs
from verl_npu.bounded_read import NotReadable
from verl_npu.envfile import EnvFile, EnvFileError, assignment_text, read_env_file
from verl_npu.errors import UserError
from verl_npu.k8s import validate
from verl_npu.k8s.defaults import (
    DEFAULT_CPU,
    DEFAULT_HOST_DIRECTORIES,
    DEFAULT_HOST_FILES,
    DEFAULT_MAX_NODES,
    DEFAULT_MEMORY,
    DEFAULT_NPU_RESOURCE,
    DEFAULT_PULL_SECRET,
    DEFAULT_SHM_SIZE,
    DEFAULT_VOLUMES,
)
from verl_npu.stack.manifest import MANIFEST_PATH, REPO_ROOT, StackError, load_stack

KINDS = ("rayjob", "volcano")
# docker/Dockerfile.a2 and .a3 copy the repository there and set docker/entrypoint.sh (CANN's
# environment) as the entrypoint; a pod's `command` replaces the entrypoint, so it is named again.
IMAGE_SOURCE = PurePosixPath("/opt/verl-npu/src/verl-npu")
IMAGE_ENTRYPOINT = IMAGE_SOURCE / "docker" / "entrypoint.sh"
CONFIG_DIR = PurePosixPath("/etc/verl-npu")
# NPUs of one node: Atlas 800T A2 servers have 8 (910B), Atlas A3 nodes 16 dies (910C); the
# upstream runners are linux-aarch64-a2b3-8 and linux-aarch64-a3-16 (docs/upstream_facts.md).
NPUS_PER_NODE_MAX = {"a2": 8, "a3": 16}
# Per-node values: the interface name (or IP) differs between nodes, and ray_start.sh sets them on
# each node. An env file that sets them forces one value on the whole cluster.
PER_NODE_KEYS = ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_IF_IP")
# Env keys naming what every node reads or writes (examples/glm5_2/glm5_2.env, ci/nightly/nightly.env and
# the directory ci/nightly/jobs/dsa_glm5_small.sh makes its model and data in when several nodes read them).
SHARED_PATH_KEYS = (
    "MODEL_PATH", "MODEL_ROOT", "DATA_ROOT", "DATASET_ROOT", "TRAIN_FILES", "VAL_FILES", "CKPT_DIR", "CKPT_ROOT",
    "DSA_JOB_DIR",
)  # fmt: skip
# Set by the renderer on every node pod; an env file or --env naming them would be overridden.
RESERVED_KEYS = ("ENV_FILE", "VERL_NPU_ENV_FILE", "VERL_NPU_EXPECT_NPUS")
DEFAULT_RAY_PORT = 6379
DASHBOARD_PORT, CLIENT_PORT = 8265, 10001
# ray_start.sh's head waits SMOKE_WAIT_S (1800 s by default) for every NPU; the other waits give that
# plus time for image pulls on the slowest node.
CLUSTER_WAIT_S = 2400
READY_MARKER = "/tmp/verl-npu-ray-ready"
SHM_MIN = "1Gi"  # verl-npu doctor fails a node whose /dev/shm is under 1 GiB
# Bounds no real cluster comes near; they stop a typo (or a hostile value) before it reaches a manifest.
CPU_MIN, CPU_MAX = "1", "4096"  # a Ray node that runs NPU workers needs a whole core
MEMORY_MIN, MEMORY_MAX = "1Gi", "1Pi"
MAX_DEADLINE_S = 366 * 24 * 3600
MAX_STEP_TIME_S = 7 * 24 * 3600
MAX_TTL_S = 30 * 24 * 3600
# Without a deadline the results pod (--results-pod) ends after a week unless cleanup.sh deletes it first.
RESULTS_POD_LIFETIME_S = 7 * 24 * 3600
# hostPath types (Kubernetes' HostPathType): the kubelet checks them before the container starts.
HOST_DIRECTORY, HOST_FILE = "Directory", "File"
# Annotations on the RayJob / Volcano Job: what the render checked and the deadline it set, and why.
PREFLIGHT_ANNOTATION = "verl-npu/preflight"
DEADLINE_ANNOTATION = "verl-npu/deadline"
GiB = 2**30
_TAG_IMAGE = re.compile(r"^(?P<repo>[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+):(?P<tag>[A-Za-z0-9._-]+)$")
_REGISTRY = re.compile(r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$")
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_POSITIVE_INT = re.compile(r"^[1-9][0-9]*$")


class RenderError(UserError):
    """A bad input: the message names the option, file or key, the value, and the fix."""


class LaunchRefused(Exception):
    """Preflight judged the launch as the pods would run it and found problems (exit 1, nothing written)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclasses.dataclass(frozen=True)
class Request:
    kind: str
    name: str
    env_file: Path
    launch: Path
    launch_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()  # --env NAME=VALUE: after the env file's own values
    image: str | None = None
    commit: str | None = None
    registry: str | None = None
    chip: str = "a3"
    nnodes: int | None = None
    npus_per_node: int | None = None
    max_nodes: int = DEFAULT_MAX_NODES  # NNODES above it is refused (defaults.py says why)
    volumes: tuple[tuple[str, str], ...] = DEFAULT_VOLUMES  # (claim, mount path)
    pull_secrets: tuple[str, ...] = (DEFAULT_PULL_SECRET,)
    npu_resource: str = DEFAULT_NPU_RESOURCE
    shm_size: str = DEFAULT_SHM_SIZE
    cpu: str = DEFAULT_CPU
    memory: str = DEFAULT_MEMORY
    ray_start: Path = Path("examples/glm5_2/ray_start.sh")
    # The run's deadline: none by default; --deadline seconds, or --step-time seconds per training step times the
    # trainer launch's trainer.total_training_steps plus --startup-time. Parsed by resolve() (verl_npu.inputs).
    deadline_s: Any = None
    step_time_s: Any = None
    startup_time_s: Any = None
    ttl_s: Any = 600
    namespace: str | None = None
    queue: str = "default"
    results_pod: bool = False
    host_directories: tuple[str, ...] = DEFAULT_HOST_DIRECTORIES
    host_files: tuple[str, ...] = DEFAULT_HOST_FILES
    # The script that runs the verl trainer when --launch runs it through another (ci/nightly/run_job.sh runs
    # ci/nightly/jobs/JOB.sh); preflight and --step-time read it. None: --launch itself, with the launch arguments.
    trainer_launch: Path | None = None
    model_config: str | None = None  # preflight's --model-config
    preflight: bool = True
    repo: Path = REPO_ROOT
    manifest: Path = MANIFEST_PATH

    @property
    def host_paths(self) -> tuple[tuple[str, str], ...]:
        """(path, hostPath type) of every host path the node pods mount."""
        return (*((p, HOST_DIRECTORY) for p in self.host_directories), *((p, HOST_FILE) for p in self.host_files))


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A request with every input read and checked."""

    request: Request
    image: str
    ray_version: str
    nnodes: int
    npus_per_node: int
    ray_port: int
    env: dict[str, str]  # what the pods' containers get (the env file's variables and the shape)
    env_file_name: str
    env_text: str  # the ConfigMap's copy of the env file
    launch: PurePosixPath  # in the image
    ray_start: PurePosixPath  # in the image
    trainer_launch: Path  # on this machine: the script preflight and the step count read
    trainer_args: tuple[str, ...]  # its arguments
    memory_bytes: float
    shm_bytes: float
    ttl_s: int
    deadline_s: int | None
    deadline_note: str  # how the deadline was set (the Job's annotation)

    @property
    def name(self) -> str:
        return self.request.name

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def env_path(self) -> PurePosixPath:
        return CONFIG_DIR / self.env_file_name


# --- inputs ---------------------------------------------------------------------------------------


def quantity(value: str, option: str) -> float:
    """A Kubernetes quantity in base units (bytes, cores); an InputError naming ``option`` (verl_npu.inputs)."""
    return inputs.quantity(option, value)


def _gib(value: float) -> str:
    return f"{value / GiB:.1f} GiB"


def _check_name(request: Request) -> None:
    name = request.name
    if request.kind == "rayjob":
        ok = validate.DNS1035_LABEL.match(name) and len(name) <= validate.RAYJOB_NAME_MAX
        limit = (
            f"at most {validate.RAYJOB_NAME_MAX} characters (KubeRay derives the RayCluster and its services from it)"
        )
    else:
        # the longest pod hostname is <name>-worker-<NNODES-2>; checked again on the rendered Job
        ok = validate.DNS1035_LABEL.match(name) and len(name) <= validate.LABEL_MAX - len("-worker-99999")
        limit = (
            f"at most {validate.LABEL_MAX - len('-worker-99999')} characters (pod hostnames are <name>-worker-<index>)"
        )
    if not ok:
        raise RenderError(
            f"--name {name!r}: must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
            f"letter, ending with a letter or digit) of {limit}; make it unique per run, e.g. "
            "verl-npu-mn-<run id>-<attempt>"
        )


def _image(request: Request) -> str:
    from verl_npu.ci.images import TAG, ghcr_registry, image_tag, manifest_digest

    if request.image is not None:
        if request.commit is not None or request.registry is not None:
            raise RenderError("--image names the whole image: give it alone, or --commit (and --registry) instead")
        m = _TAG_IMAGE.match(request.image)
        tag = TAG.match(m["tag"]) if m else None
        if tag is None:
            raise RenderError(
                f"--image {request.image!r}: expected REGISTRY/verl-npu:<chip>-<manifest sha>-<commit>, the tag "
                "`verl-npu ci image-tag` gives (never a floating tag such as latest)"
            )
        if tag["chip"] != request.chip:
            raise RenderError(
                f"--image {request.image!r} is built for chip {tag['chip']!r} but --chip is {request.chip!r}"
            )
        digest = manifest_digest(request.manifest)
        if tag["manifest"] != digest:
            raise RenderError(
                f"--image {request.image!r} was built from another stack manifest (digest {tag['manifest']}, "
                f"{request.manifest} has {digest}): render from the commit the image was built from, or build "
                "the image of this commit"
            )
        return request.image
    if request.commit is None:
        raise RenderError("give --image (the image built for this commit), or --commit with --registry")
    registry = request.registry
    try:
        if registry is None:
            owner = os.environ.get("GITHUB_REPOSITORY_OWNER", "")
            if not owner:
                raise RenderError("--registry is required with --commit outside GitHub Actions (e.g. ghcr.io/<owner>)")
            registry = ghcr_registry(owner)  # what the images workflow pushes to
        if not _REGISTRY.match(registry):
            raise RenderError(f"--registry {registry!r}: expected a lowercase registry path such as ghcr.io/<owner>")
        return image_tag(request.chip, request.commit, manifest=request.manifest, registry=registry)
    except ValueError as exc:
        if isinstance(exc, RenderError):
            raise
        raise RenderError(f"--commit/--registry: {exc}") from None


def _repo_file(path: Path, repo: Path, option: str) -> Path:
    """A file of the repository, on this machine (the images carry the repository at IMAGE_SOURCE)."""
    full = (path if path.is_absolute() else repo / path).resolve()
    root = repo.resolve()
    if not full.is_relative_to(root):
        raise RenderError(
            f"{option} {path}: not inside the repository {root}; the pods run it from the image, which holds "
            f"the repository at {IMAGE_SOURCE}: commit it to the repository and build the image"
        )
    if not full.is_file():
        raise RenderError(f"{option} {path}: no such file in {root}")
    return full


def _in_repo(path: Path, repo: Path, option: str) -> PurePosixPath:
    """The image path of a file of the repository."""
    return IMAGE_SOURCE / _repo_file(path, repo, option).relative_to(repo.resolve()).as_posix()


def _shape(request: Request, values: dict[str, str], key: str, flag: int | None, option: str, most: int) -> int:
    in_file = values.get(key)
    if in_file is not None and not _POSITIVE_INT.match(in_file):
        raise RenderError(f"{request.env_file}: {key}={in_file!r} is not a positive integer")
    if in_file is not None:
        inputs.integer(key, in_file, minimum=1, maximum=most, source=str(request.env_file))
    if flag is not None:
        flag = inputs.integer(option, flag, minimum=1, maximum=most)
    if in_file is not None and flag is not None and int(in_file) != flag:
        raise RenderError(f"{option} {flag} contradicts {key}={in_file} in {request.env_file}: drop one of them")
    if in_file is None and flag is None:
        raise RenderError(f"{request.env_file}: {key} is missing: set it in the env file or pass {option}")
    return int(in_file) if in_file is not None else flag  # type: ignore[return-value]


def _check_shared_paths(request: Request, values: dict[str, str]) -> None:
    mounts = [PurePosixPath(m) for _, m in request.volumes]
    for key in SHARED_PATH_KEYS:
        if key not in values:
            continue
        value = values[key]
        # TRAIN_FILES / VAL_FILES may be a Hydra list: "[/a.parquet,/b.parquet]"
        paths = [p.strip(" '\"") for p in value.strip("[]").split(",") if p.strip(" '\"")]
        for path in paths or [value]:
            pure = PurePosixPath(path)
            if not pure.is_absolute() or not any(pure.is_relative_to(m) for m in mounts):
                raise RenderError(
                    f"{request.env_file}: {key}={value!r} is not on the shared storage every pod mounts "
                    f"({', '.join(map(str, mounts))}): nodes other than the head could not read it. Move it under "
                    "a shared mount (e.g. /root/.cache/models/<org>/<name>, /root/.cache/datasets) or mount its "
                    "ReadWriteMany claim with --pvc CLAIM=MOUNT"
                )


def _check_volumes(request: Request) -> None:
    seen: set[str] = set()
    if not request.volumes:
        raise RenderError("--pvc: give at least one shared ReadWriteMany claim (CLAIM=MOUNT)")
    for claim, mount in request.volumes:
        if not validate.DNS1123_SUBDOMAIN.match(claim) or len(claim) > validate.SUBDOMAIN_MAX:
            raise RenderError(f"--pvc {claim}={mount}: {claim!r} is not a valid PersistentVolumeClaim name")
        pure = PurePosixPath(mount)
        if not pure.is_absolute() or str(pure) != mount or mount == "/":
            raise RenderError(
                f"--pvc {claim}={mount}: the mount path must be an absolute, normalised path other than /"
            )
        if mount in seen or mount in ("/dev/shm", str(CONFIG_DIR)):
            raise RenderError(
                f"--pvc {claim}={mount}: {mount} is already mounted (by another --pvc, /dev/shm or the config)"
            )
        seen.add(mount)
    for path, kind in request.host_paths:
        option = "--host-path" if kind == HOST_DIRECTORY else "--host-file"
        pure = PurePosixPath(path)
        if not pure.is_absolute() or str(pure) != path or path == "/" or path in seen:
            raise RenderError(f"{option} {path!r}: give an absolute, normalised path that no other mount uses")
        seen.add(path)
    for option, value in (
        *(("--pvc", f"{claim}={mount}") for claim, mount in request.volumes),
        *(("--host-path" if kind == HOST_DIRECTORY else "--host-file", p) for p, kind in request.host_paths),
    ):
        _check_printable(option, value)


def _check_printable(option: str, value: str) -> None:
    """A value written into the manifests' YAML and the node scripts holds no control character: YAML turns a CR
    or NEL into a newline, and a newline in a path or a script's argument is never what was meant."""
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        raise RenderError(f"{option} {value!r}: holds {bad!r} (U+{ord(bad):04X}), a character that is not printable")


def _extra_env(request: Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in request.extra_env:
        if not key.isidentifier() or not key.isascii():
            raise RenderError(f"--env {key}={value}: {key!r} is not a variable name")
        if key in ("NNODES", "NPUS_PER_NODE", "RAY_PORT") or key in RESERVED_KEYS:
            raise RenderError(
                f"--env {key}: set by the env file or the renderer's own options (--nnodes, --npus-per-node)"
            )
        try:
            assignment_text(key, value)  # what the env file in the ConfigMap will say, read back by bash and verl-npu
        except EnvFileError as exc:
            raise RenderError(
                f"--env {exc}: the rendered env file could not say it so that bash and the pods read the same value"
            ) from None
        out[key] = value
    return out


def _ray_pin(request: Request) -> str:
    try:
        stack = load_stack(request.manifest)
    except StackError as exc:
        raise RenderError(str(exc)) from None
    if request.chip not in stack.chips:
        raise RenderError(f"--chip {request.chip!r}: the stack manifest has {', '.join(sorted(stack.chips))}")
    ray = stack.packages.get("ray")
    if ray is None:
        raise RenderError(
            f"{request.manifest}: no [packages.ray]: the RayJob's rayVersion and the nodes' Ray come from that pin"
        )
    return ray.version


def _read_env_file(request: Request) -> EnvFile:
    if not os.path.lexists(request.env_file):
        raise RenderError(f"--env-file {request.env_file}: no such file")
    try:
        return read_env_file(request.env_file)
    except NotReadable as exc:
        raise RenderError(f"--env-file {request.env_file}: cannot read: {exc}") from None
    except EnvFileError as exc:
        raise RenderError(f"--env-file: {exc}") from None


def _check_env_keys(request: Request, values: dict[str, str], overrides: dict[str, str]) -> None:
    for key in PER_NODE_KEYS:
        if key in values or key in overrides:
            where = str(request.env_file) if key in values else "--env"
            raise RenderError(
                f"{where}: {key} would force one value on every node, but interface names and IPs differ between "
                "nodes: remove it; ray_start.sh sets it on each node"
            )
    reserved = [k for k in RESERVED_KEYS if k in values]
    if reserved:
        raise RenderError(f"{request.env_file}: {', '.join(reserved)} is set by the renderer on every pod: remove it")


def _cluster_shape(request: Request, values: dict[str, str]) -> tuple[int, int, str]:
    nnodes = _shape(request, values, "NNODES", request.nnodes, "--nnodes", inputs.MAX_DEVICES)
    if nnodes > request.max_nodes:
        raise RenderError(
            f"NNODES={nnodes} ({request.env_file} or --nnodes): more than --max-nodes {request.max_nodes}, the node "
            f"pods a render writes (each holds a whole node's NPUs; Kubernetes supports at most {DEFAULT_MAX_NODES} "
            "nodes per cluster): give the nodes the job runs on, or pass --max-nodes with the nodes your cluster has"
        )
    npus = _shape(request, values, "NPUS_PER_NODE", request.npus_per_node, "--npus-per-node", inputs.MAX_DEVICES)
    if npus > NPUS_PER_NODE_MAX[request.chip]:
        raise RenderError(
            f"NPUS_PER_NODE={npus} ({request.env_file} or --npus-per-node): an {request.chip.upper()} node has "
            f"{NPUS_PER_NODE_MAX[request.chip]} NPUs"
        )
    port_text = values.get("RAY_PORT", str(DEFAULT_RAY_PORT))
    if not _POSITIVE_INT.match(port_text) or int(port_text) > 65535:
        raise RenderError(f"{request.env_file}: RAY_PORT={port_text!r} is not a TCP port")
    return nnodes, npus, port_text


def _check_pod_options(request: Request) -> None:
    for secret in request.pull_secrets:
        if not validate.DNS1123_SUBDOMAIN.match(secret) or len(secret) > validate.SUBDOMAIN_MAX:
            raise RenderError(f"--pull-secret {secret!r}: not a valid Secret name (DNS-1123 subdomain)")
    if not _RESOURCE_NAME.match(request.npu_resource):
        raise RenderError(
            f"--npu-resource {request.npu_resource!r}: expected a device plugin resource such as "
            f"{DEFAULT_NPU_RESOURCE} or huawei.com/Ascend910"
        )
    if request.namespace is not None and not validate.DNS1123_LABEL.match(request.namespace):
        raise RenderError(f"--namespace {request.namespace!r}: not a valid namespace name")
    if request.kind == "volcano" and not validate.DNS1123_SUBDOMAIN.match(request.queue):
        raise RenderError(f"--queue {request.queue!r}: not a valid Volcano queue name")


@dataclasses.dataclass(frozen=True)
class _Numbers:
    """The numeric options, each parsed and range-checked (verl_npu.inputs)."""

    memory_bytes: float
    shm_bytes: float
    ttl_s: int
    deadline_s: int | None
    step_time_s: float | None
    startup_time_s: int


def _numbers(request: Request) -> _Numbers:
    """Every numeric option at once: one RenderError lists each bad one."""
    errors: list[str] = []

    def parse(parser, *args, **kwargs):
        try:
            return parser(*args, **kwargs)
        except UserError as exc:
            errors.append(str(exc))
            return None

    parse(inputs.quantity, "--cpu", request.cpu, minimum=CPU_MIN, maximum=CPU_MAX)
    memory = parse(inputs.quantity, "--memory", request.memory, minimum=MEMORY_MIN, maximum=MEMORY_MAX)
    shm = parse(inputs.quantity, "--shm-size", request.shm_size, minimum=SHM_MIN, maximum=MEMORY_MAX)
    ttl = parse(inputs.integer, "--ttl", request.ttl_s, minimum=1, maximum=MAX_TTL_S)
    deadline = step = startup = None
    if request.deadline_s is not None:
        deadline = parse(inputs.integer, "--deadline", request.deadline_s, minimum=1, maximum=MAX_DEADLINE_S)
    if request.step_time_s is not None:
        step = parse(inputs.number, "--step-time", request.step_time_s, above=0, maximum=MAX_STEP_TIME_S)
    if request.startup_time_s is not None:
        startup = parse(inputs.integer, "--startup-time", request.startup_time_s, minimum=0, maximum=MAX_DEADLINE_S)
    if request.deadline_s is not None and request.step_time_s is not None:
        errors.append("--deadline and --step-time both set the run's deadline: give one of them")
    if request.startup_time_s is not None and request.step_time_s is None:
        errors.append("--startup-time counts only with --step-time (the deadline is startup + steps x step time)")
    if memory is not None and shm is not None and shm >= memory:
        errors.append(
            f"--shm-size {request.shm_size} leaves nothing of --memory {request.memory} for the node's processes: a "
            "memory-backed /dev/shm is charged to the container's memory limit as it fills"
        )
    if errors:
        raise RenderError("; ".join(errors))
    return _Numbers(memory, shm, ttl, deadline, step, CLUSTER_WAIT_S if startup is None else startup)


def _with_additions(env: EnvFile, added: dict[str, str]) -> str:
    """The env file with ``added`` set: a key the file sets already has its line commented out, so that each key has
    one line (the reader refuses two: `source` and the pod spec could pick different ones)."""
    if not added:
        return env.text
    lines = env.text.split("\n")
    for key in added:
        if key in env.lines:
            number = env.lines[key]
            lines[number - 1] = f"# {lines[number - 1].strip()}  (replaced by --env {key}, below)"
    note = "# Added by `verl-npu k8s render`: --env, and the cluster shape when given as flags.\n"
    env_text = "\n".join(lines).rstrip("\n") + "\n\n" + note
    return env_text + "".join(assignment_text(k, v) + "\n" for k, v in added.items())


@contextlib.contextmanager
def launch_environment(cluster: Cluster) -> Iterator[dict[str, str]]:
    """The environment the launch starts with in a node pod, on this machine: the pods' variables, with ENV_FILE and
    VERL_NPU_ENV_FILE pointing at a copy of the ConfigMap's env file (the launch sources it, as in the pods)."""
    with tempfile.TemporaryDirectory(prefix="verl-npu-render-") as directory:
        env_path = Path(directory) / cluster.env_file_name
        atomic.write_text(env_path, cluster.env_text)
        yield {
            **cluster.env,
            "ENV_FILE": str(env_path),
            "VERL_NPU_ENV_FILE": str(env_path),
            "VERL_NPU_EXPECT_NPUS": str(cluster.npus_per_node),
        }


STEPS_KEY = "trainer.total_training_steps"


def _shown(cluster: Cluster) -> Path:
    """The trainer launch as messages name it: relative to the repository."""
    return cluster.trainer_launch.relative_to(cluster.request.repo.resolve())


def training_steps(cluster: Cluster) -> int:
    """The trainer launch's trainer.total_training_steps (the last override wins, as in Hydra); RenderError when the
    launch runs no trainer or leaves the count to verl (total_epochs over the data: known only at run time)."""
    from verl_npu.preflight.launch import read_launch_script

    script = _shown(cluster)
    with launch_environment(cluster) as env:
        launch = read_launch_script(cluster.trainer_launch, cluster.trainer_args, env)
    if launch.module is None:
        raise RenderError(
            f"--step-time: no command in {script} runs the verl trainer, so its steps are unknown: name the script "
            "that does with --trainer-launch, or give --deadline"
        )
    value: str | None = None
    for override in launch.overrides:
        key, sep, text = override.partition("=")
        if key.lstrip("+~") == STEPS_KEY:
            value = None if key.startswith("~") or not sep or text.strip().lower() == "null" else text
    if value is None:
        raise RenderError(
            f"--step-time: {script} sets no {STEPS_KEY} (verl then trains total_epochs over the data, a step count "
            f"known only at run time): set it in the launch or after --, or give --deadline"
        )
    return inputs.integer(STEPS_KEY, value, minimum=1, maximum=inputs.MAX_BATCH, source=str(script))


def _deadline(cluster: Cluster, numbers: _Numbers) -> tuple[int | None, str]:
    """(activeDeadlineSeconds or None, how it was set)."""
    if numbers.deadline_s is not None:
        return numbers.deadline_s, f"{numbers.deadline_s} s (--deadline)"
    if numbers.step_time_s is None:
        return None, "none: Kubernetes does not stop the run (--deadline or --step-time set one)"
    steps = training_steps(cluster)
    deadline = numbers.startup_time_s + math.ceil(steps * numbers.step_time_s)
    how = (
        f"{deadline} s = {numbers.startup_time_s} s to start + {steps} steps ({STEPS_KEY} of "
        f"{cluster.trainer_launch.name}) x {numbers.step_time_s:g} s (--step-time)"
    )
    if deadline > MAX_DEADLINE_S:
        raise RenderError(f"--step-time: a deadline of {how} exceeds {MAX_DEADLINE_S} s (366 days)")
    return deadline, how


def resolve(request: Request) -> Cluster:
    """Read and check every input of ``request``; RenderError names the bad one (all numeric options at once)."""
    if request.kind not in KINDS:
        raise RenderError(f"kind {request.kind!r}: choose one of {', '.join(KINDS)}")
    _check_name(request)
    numbers = _numbers(request)
    ray_version = _ray_pin(request)
    image = _image(request)
    env_file = _read_env_file(request)
    values = env_file.variables
    overrides = _extra_env(request)
    _check_env_keys(request, values, overrides)
    nnodes, npus, port_text = _cluster_shape(request, values)
    _check_volumes(request)
    _check_shared_paths(request, {**values, **overrides})
    _check_pod_options(request)
    for argument in request.launch_args:
        _check_printable("launch argument", argument)

    launch = _in_repo(request.launch, request.repo, "--launch")
    ray_start = _in_repo(request.ray_start, request.repo, "--ray-start")
    if request.trainer_launch is None:
        trainer, trainer_args = _repo_file(request.launch, request.repo, "--launch"), request.launch_args
    else:  # the launch's own arguments are for --launch, not for the script it runs
        trainer, trainer_args = _repo_file(request.trainer_launch, request.repo, "--trainer-launch"), ()
    name = request.env_file.name
    if not validate.CONFIGMAP_KEY.match(name) or name in ("head.sh", "worker.sh", "entrypoint.sh"):
        raise RenderError(
            f"--env-file {request.env_file}: rename it (letters, digits, '-', '_', '.'; not a node script's name)"
        )

    shape = {"NNODES": str(nnodes), "NPUS_PER_NODE": str(npus), "RAY_PORT": port_text}
    added = {**{k: v for k, v in shape.items() if k not in values}, **overrides}
    cluster = Cluster(
        request=request, image=image, ray_version=ray_version, nnodes=nnodes, npus_per_node=npus,
        ray_port=int(port_text), env={**values, **added}, env_file_name=name, env_text=_with_additions(env_file, added),
        launch=launch, ray_start=ray_start, trainer_launch=trainer, trainer_args=tuple(trainer_args),
        memory_bytes=numbers.memory_bytes, shm_bytes=numbers.shm_bytes, ttl_s=numbers.ttl_s,
        deadline_s=None, deadline_note="",
    )  # fmt: skip
    deadline, note = _deadline(cluster, numbers)
    return dataclasses.replace(cluster, deadline_s=deadline, deadline_note=note)


# --- preflight ----------------------------------------------------------------------------------------


def preflight(cluster: Cluster) -> str:
    """Preflight of the trainer launch as the pods run it; what it found, for the Job's annotation.

    LaunchRefused lists every problem: each failed check of a NO-GO, and a busiest node whose host RAM (preflight's
    estimate: offloaded actor state and the rollout's sleep-mode weight copies) plus the memory-backed /dev/shm
    exceeds the pod's memory request and limit.
    """
    from verl_npu.preflight import run_preflight

    request = cluster.request
    if not request.preflight:
        return "not run (--no-preflight): the launch and its host RAM were not checked against --memory"
    with launch_environment(cluster) as env:
        report = run_preflight(
            cluster.trainer_launch, cluster.trainer_args, env=env, chip=request.chip, model_config=request.model_config
        )
    where = f"preflight of {_shown(cluster)}"
    fixes = {"launch.no-trainer": "name the script --launch runs the trainer through with --trainer-launch"}
    problems = [
        f"{where}: {c.check}: {c.detail}" + (f" (fix: {c.fix or fixes[c.check]})" if c.fix or c.check in fixes else "")
        for c in report.checks
        if c.status == "fail"
    ]
    memory = report.memory
    if memory is None and problems:
        problems.append(f"{where} makes no host RAM estimate until the failures above are fixed: --memory unchecked")
        raise LaunchRefused(problems)
    if memory is None:
        why = next((c.detail for c in report.checks if c.check.startswith(("memory.", "config.not-computed"))), "")
        problems.append(
            f"{where} computed no host RAM estimate{': ' + why if why else ''}; the pods' --memory {request.memory} "
            "cannot be checked against it: fix the launch, name the script that runs the trainer (--trainer-launch), "
            "or render without the check (--no-preflight)"
        )
        raise LaunchRefused(problems)
    node_bytes = memory.node_host_bytes
    needed = node_bytes + cluster.shm_bytes
    parts = (
        f"{_gib(memory.host_bytes_per_node)} of offloaded actor state + {_gib(memory.rollout_host_bytes_per_node)} "
        "of the rollout's sleep-mode weight copies"
    )
    summary = (
        f"node {memory.worst_node}, the busiest, needs {_gib(node_bytes)} of host RAM ({parts}) + --shm-size "
        f"{request.shm_size} of /dev/shm = {_gib(needed)}"
    )
    if needed > cluster.memory_bytes:
        problems.append(
            f"--memory {request.memory}: {summary}, more than the {_gib(cluster.memory_bytes)} each node pod requests "
            f"and may use. Render with --memory {math.ceil(needed / GiB)}Gi or more where the nodes' allocatable "
            "memory holds it (kubectl get nodes -o "
            "custom-columns=NAME:.metadata.name,MEMORY:.status.allocatable.memory), a smaller --shm-size, or a launch "
            "that keeps less on the host (ci/k8s/README.md)"
        )
    if problems:
        raise LaunchRefused(problems)
    return f"go: {summary}, within --memory {request.memory}"


# --- node scripts -------------------------------------------------------------------------------------


def _script(purpose: str, lines: list[str]) -> str:
    header = [
        "#!/usr/bin/env bash",
        f"# {purpose}",
        "# Written by `verl-npu k8s render`; edit the inputs and render again.",
        "set -euo pipefail",
    ]
    return "\n".join(header + lines) + "\n"


_ULIMIT = 'ulimit -n 65536 || echo "open files limit stays at $(ulimit -n)" >&2  # as KubeRay raises it for Ray'


def _launch_lines(cluster: Cluster) -> list[str]:
    command = shlex.join(["bash", str(cluster.launch), *cluster.request.launch_args])
    return [f"cd {shlex.quote(str(IMAGE_SOURCE))}", f"exec {command}"]


def head_script(cluster: Cluster) -> str:
    start = f"bash {shlex.quote(str(cluster.ray_start))} head"
    if cluster.request.kind == "rayjob":
        return _script(
            "Ray head: ray_start.sh (Ray, then every NPU registered and an HCCL smoke test), then the marker the "
            "RayJob's entrypoint waits for; the container lives as long as Ray.",
            [_ULIMIT, start, f"touch {READY_MARKER}", "exec sleep infinity"],
        )
    return _script(
        "Head of the Volcano job: ray_start.sh (Ray, then every NPU registered and an HCCL smoke test), then the "
        "launch; the job completes with it.",
        [_ULIMIT, start, *_launch_lines(cluster)],
    )


def worker_script(cluster: Cluster) -> str:
    if cluster.request.kind == "rayjob":
        head = ['head_host="$FQ_RAY_IP"  # set by KubeRay: the head service of this cluster']
    else:
        host = f"{cluster.name}-head-0.{cluster.name}"
        head = [f"head_host={shlex.quote(host)}  # Volcano's svc plugin: <job>-<task>-<index>.<job>"]
    return _script(
        "Ray worker: wait for the head's Ray port, then ray_start.sh worker with the head's IP (ray_start.sh picks "
        "this node's interface for HCCL from it).",
        [
            _ULIMIT,
            *head,
            f"deadline=$((SECONDS + {CLUSTER_WAIT_S}))",
            'until head_ip="$(getent hosts "$head_host" | awk \'{print $1; exit}\')" && [[ -n "$head_ip" ]] \\',
            f'    && (exec 3<>"/dev/tcp/$head_ip/{cluster.ray_port}") 2>/dev/null; do',
            "  if ((SECONDS >= deadline)); then",
            f'    echo "worker.sh: the Ray head $head_host:{cluster.ray_port} did not answer within '
            f'{CLUSTER_WAIT_S} s" >&2',
            "    exit 1",
            "  fi",
            "  sleep 5",
            "done",
            f'bash {shlex.quote(str(cluster.ray_start))} worker "$head_ip"',
            "exec sleep infinity",
        ],
    )


def entrypoint_script(cluster: Cluster) -> str:
    total = cluster.nnodes * cluster.npus_per_node
    return _script(
        "The RayJob's entrypoint, on the head: wait until the head's ray_start.sh has seen every NPU, then the launch.",
        [
            f"deadline=$((SECONDS + {CLUSTER_WAIT_S}))",
            f"until [[ -e {READY_MARKER} ]]; do",
            "  if ((SECONDS >= deadline)); then",
            f"    echo \"entrypoint.sh: the head's ray_start.sh did not see {total} NPUs ({cluster.nnodes} x "
            f"{cluster.npus_per_node}) pass the HCCL smoke test within {CLUSTER_WAIT_S} s: see the head pod's "
            'log" >&2',
            "    exit 1",
            "  fi",
            "  sleep 10",
            "done",
            *_launch_lines(cluster),
        ],
    )


# --- objects --------------------------------------------------------------------------------------


def _labels(cluster: Cluster, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "verl-npu", "app.kubernetes.io/instance": cluster.name}
    if role:
        labels["app.kubernetes.io/component"] = role
    return labels


def _metadata(cluster: Cluster, name: str, role: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if cluster.request.namespace:
        meta["namespace"] = cluster.request.namespace
    meta["labels"] = _labels(cluster, role)
    return meta


def _shared_volumes(cluster: Cluster, read_only: bool = False) -> tuple[list[dict], list[dict]]:
    volumes, mounts = [], []
    for index, (claim, mount) in enumerate(cluster.request.volumes):
        volumes.append({"name": f"shared-{index}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"shared-{index}", "mountPath": mount, **({"readOnly": True} if read_only else {})})
    return volumes, mounts


def _pull_secrets(cluster: Cluster) -> list[dict[str, str]]:
    return [{"name": s} for s in cluster.request.pull_secrets]


def _node_pod(cluster: Cluster, role: str, script: str) -> dict[str, Any]:
    request = cluster.request
    npu = {request.npu_resource: cluster.npus_per_node, "cpu": request.cpu, "memory": request.memory}
    shared, shared_mounts = _shared_volumes(cluster)
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": request.shm_size}},
        {"name": "config", "configMap": {"name": cluster.config_map}},
        *shared,
        *(
            {"name": f"host-{i}", "hostPath": {"path": p, "type": kind}}
            for i, (p, kind) in enumerate(request.host_paths)
        ),
    ]
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": str(CONFIG_DIR), "readOnly": True},
        *shared_mounts,
        *({"name": f"host-{i}", "mountPath": p, "readOnly": True} for i, (p, _) in enumerate(request.host_paths)),
    ]
    env = [
        {"name": "ENV_FILE", "value": str(cluster.env_path)},  # ray_start.sh and the example launch read it
        {"name": "VERL_NPU_ENV_FILE", "value": str(cluster.env_path)},
        # each pod holds a whole node's NPUs: the NPU check and `verl-npu doctor` fail a node that sees fewer
        {"name": "VERL_NPU_EXPECT_NPUS", "value": str(cluster.npus_per_node)},
        *({"name": k, "value": v} for k, v in cluster.env.items()),
    ]
    container: dict[str, Any] = {
        "name": f"ray-{role}",
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",  # the tag names one build (manifest + commit)
        "command": [str(IMAGE_ENTRYPOINT), "bash", str(CONFIG_DIR / script)],
        "env": env,
        "resources": {"limits": dict(npu), "requests": dict(npu)},  # equal: the pod is Guaranteed, evicted last
        "volumeMounts": mounts,
    }
    if role == "head":
        container["ports"] = [
            {"name": "gcs-server", "containerPort": cluster.ray_port},
            {"name": "dashboard", "containerPort": DASHBOARD_PORT},
            {"name": "client", "containerPort": CLIENT_PORT},
        ]
    spec: dict[str, Any] = {"imagePullSecrets": _pull_secrets(cluster), "containers": [container], "volumes": volumes}
    metadata: dict[str, Any] = {"labels": _labels(cluster, role)}
    if request.kind == "rayjob":
        # KubeRay would replace the command with its own `ray start`; ray_start.sh starts Ray here.
        metadata["annotations"] = {"ray.io/overwrite-container-cmd": "true"}
    else:
        spec["restartPolicy"] = "Never"
        if cluster.deadline_s is not None:
            spec["activeDeadlineSeconds"] = cluster.deadline_s
    return {"metadata": metadata, "spec": spec}


def config_map(cluster: Cluster) -> dict[str, Any]:
    data = {
        cluster.env_file_name: cluster.env_text,
        "head.sh": head_script(cluster),
        "worker.sh": worker_script(cluster),
    }
    if cluster.request.kind == "rayjob":
        data["entrypoint.sh"] = entrypoint_script(cluster)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(cluster, cluster.config_map), "data": data}


def rayjob(cluster: Cluster) -> dict[str, Any]:
    cluster_spec: dict[str, Any] = {
        "rayVersion": cluster.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {"rayStartParams": {}, "template": _node_pod(cluster, "head", "head.sh")},
    }
    workers = cluster.nnodes - 1
    if workers:
        cluster_spec["workerGroupSpecs"] = [
            {
                "groupName": "npu",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": {},
                "template": _node_pod(cluster, "worker", "worker.sh"),
            }
        ]
    submitter = {
        "metadata": {"labels": _labels(cluster, "submitter")},
        "spec": {
            "restartPolicy": "Never",
            "imagePullSecrets": _pull_secrets(cluster),
            "containers": [
                {
                    "name": "ray-job-submitter",  # KubeRay fills in the `ray job submit` command
                    "image": cluster.image,
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "512Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                }
            ],
        },
    }
    spec: dict[str, Any] = {
        "entrypoint": f"bash {CONFIG_DIR / 'entrypoint.sh'}",
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": cluster.ttl_s,
    }
    if cluster.deadline_s is not None:
        spec["activeDeadlineSeconds"] = cluster.deadline_s
    spec.update(
        backoffLimit=0,  # a failed multi-node run is investigated, not retried on 32 nodes
        submitterPodTemplate=submitter,
        rayClusterSpec=cluster_spec,
    )
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _metadata(cluster, cluster.name), "spec": spec}


def volcano_job(cluster: Cluster) -> dict[str, Any]:
    request = cluster.request
    tasks: list[dict[str, Any]] = [
        {
            "name": "head",
            "replicas": 1,
            "template": _node_pod(cluster, "head", "head.sh"),
            "policies": [{"event": "TaskCompleted", "action": "CompleteJob"}],
        }
    ]
    if cluster.nnodes > 1:
        tasks.append(
            {"name": "worker", "replicas": cluster.nnodes - 1, "template": _node_pod(cluster, "worker", "worker.sh")}
        )
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": _metadata(cluster, cluster.name),
        "spec": {
            "schedulerName": "volcano",
            "queue": request.queue,
            "minAvailable": cluster.nnodes,  # gang scheduling: all nodes or none
            "maxRetry": 0,
            "ttlSecondsAfterFinished": cluster.ttl_s,
            # hostnames <job>-<task>-<index>.<job> for the workers to find the head
            "plugins": {"svc": ["--publish-not-ready-addresses"]},
            "policies": [{"event": "PodFailed", "action": "AbortJob"}, {"event": "PodEvicted", "action": "AbortJob"}],
            "tasks": tasks,
        },
    }


def results_pod(cluster: Cluster) -> dict[str, Any]:
    """A small pod with the shared storage mounted, to copy results out (`kubectl cp`) whether or not
    the Ray cluster still exists; it ends by itself an hour after the job's deadline (a week without one)."""
    lifetime = cluster.deadline_s + 3600 if cluster.deadline_s is not None else RESULTS_POD_LIFETIME_S
    volumes, mounts = _shared_volumes(cluster)  # writable: the run's scratch is removed through it
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(cluster, f"{cluster.name}-results", "results"),
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": lifetime,
            "imagePullSecrets": _pull_secrets(cluster),
            "containers": [
                {
                    "name": "results",
                    "image": cluster.image,
                    "command": ["sleep", str(lifetime)],
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "128Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }


def render(request: Request) -> list[dict[str, Any]]:
    """The objects of ``request``, checked by the validator (verl_npu.k8s.validate); RenderError on a bad input
    or when the schemas cannot be loaded, LaunchRefused when preflight refuses the launch or its memory request."""
    cluster = resolve(request)
    checked = preflight(cluster)
    job = rayjob(cluster) if request.kind == "rayjob" else volcano_job(cluster)
    job["metadata"]["annotations"] = {PREFLIGHT_ANNOTATION: checked, DEADLINE_ANNOTATION: cluster.deadline_note}
    docs = [config_map(cluster), job]
    if request.results_pod:
        docs.append(results_pod(cluster))
    try:
        problems = validate.validate_documents(docs, "rendered", request.max_nodes)
    except validate.ManifestError as exc:  # the schemas are missing (kubernetes-validate not installed)
        raise RenderError(f"cannot validate the manifests: {exc}") from None
    if problems:  # a renderer bug, not a user error: say so
        raise AssertionError("the rendered manifests do not validate:\n" + "\n".join(map(str, problems)))
    return docs


def dump(docs: list[dict[str, Any]]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None  # scripts and the env file stay readable
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    header = "# Rendered by `verl-npu k8s render`; edit its inputs (env file, launch, options) and render again.\n"
    return header + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)
