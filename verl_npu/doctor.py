"""``verl-npu doctor``: per-node environment check against the stack manifest.

Every rule reads a :class:`Probe`, never the process directly, so tests drive each rule with a
constructed environment (fake site-packages trees, environment variables, command outputs).
Nothing here imports torch, torch_npu or megatron: a broken CANN setup must not crash the doctor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu.stack import NPU_TARGETS, REPO_ROOT, Stack, build_manifest, load_stack

OK, WARN, FAIL = "ok", "warn", "fail"
LAYER_MODULE = "verl_npu.megatron_adaptor"
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str
    detail: str
    fix: str = ""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> str:
    """'2.10.0.post4' -> '2.10.0'; '2.10.0+cpu' -> '2.10.0'."""
    match = re.match(r"^\d+(\.\d+)*", version)
    return match.group(0) if match else version


def _run_command(argv: Sequence[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _node_network_checks(env: Mapping[str, str]) -> list[Finding]:
    from verl_npu.cluster.network import check_network  # it imports this module

    return check_network(env)


@dataclasses.dataclass
class Probe:
    """What the doctor looks at. ``Probe.current()`` reads this process and node."""

    env: Mapping[str, str]
    sys_path: Sequence[str]
    run: Callable[[Sequence[str]], str | None] = _run_command
    shm_path: Path = Path("/dev/shm")
    mem_total_bytes: int | None = None
    rlimits: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    build_manifest_path: Path | None = None
    ascend_root: Path = Path("/usr/local/Ascend")
    which: Callable[[str], str | None] = shutil.which
    # the node's network checks (verl_npu.cluster.network.check_network); None: not checked here
    network: Callable[[Mapping[str, str]], list[Finding]] | None = None

    @classmethod
    def current(cls) -> Probe:
        mem = None
        with contextlib.suppress(ValueError, OSError):
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(
            env=dict(os.environ),
            sys_path=list(sys.path),
            mem_total_bytes=mem,
            rlimits={
                "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK),
            },
            build_manifest_path=build_manifest.find(),
            meta_path=list(sys.meta_path),
            network=_node_network_checks,
        )

    # --- derived views (cached) -------------------------------------------------------------
    @property
    def distributions(self) -> dict[str, list[tuple[str, str]]]:
        """canonical name -> [(version, location)], every copy found on sys_path."""
        if not hasattr(self, "_dists"):
            found: dict[str, list[tuple[str, str]]] = {}
            seen: set[str] = set()
            for dist in importlib.metadata.distributions(path=list(self.sys_path)):
                name = dist.metadata["Name"]
                location = str(getattr(dist, "_path", ""))
                if not name or location in seen:
                    continue
                seen.add(location)
                found.setdefault(_canonical(name), []).append((dist.version, location))
            self._dists = found
        return self._dists

    def version(self, dist: str) -> str | None:
        copies = self.distributions.get(_canonical(dist))
        return copies[0][0] if copies else None

    meta_path: Sequence[Any] = ()  # import hooks such as editable installs' finders (current process only)

    def module_locations(self, dotted: str) -> list[str]:
        """Every sys_path entry (or import hook) that provides ``dotted``; the first one wins."""
        parts = dotted.split(".")
        starts = [[entry or "."] for entry in self.sys_path]
        for finder in self.meta_path:  # editable installs resolve their top-level package here
            if isinstance(finder, type) and issubclass(finder, importlib.machinery.PathFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            top = find_spec(parts[0], None) if find_spec is not None else None
            if top is not None and top.submodule_search_locations is not None:
                starts.append([str(Path(loc).parent) for loc in top.submodule_search_locations])
        locations = []
        for path in starts:
            spec = None
            for i, part in enumerate(parts):
                spec = importlib.machinery.PathFinder.find_spec(part, path)
                if spec is None:
                    break
                if i < len(parts) - 1:
                    path = list(spec.submodule_search_locations or [])
            if spec is not None and (spec.origin or spec.submodule_search_locations):
                origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
                if origin not in locations:
                    locations.append(origin)
        return locations


# --- platform ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Platform:
    kind: str  # ascend | cuda | cpu
    target: str  # a2 | a3 | dev
    detail: str
    devices: int | None = None  # NPUs or GPUs listed by npu-smi / nvidia-smi


def detect_platform(probe: Probe) -> Platform:
    npu = probe.run(["npu-smi", "info"])
    if npu is not None:
        count = len(set(re.findall(r"^\|\s*(\d+)\s+\S*910", npu, flags=re.M))) or None
        shown = count or "?"
        # "A3" only as a word of its own: a PCI Bus-Id such as 0000:A3:00.0 on a 910B node is not A3.
        if re.search(r"910_93|(?<![\w:])A3(?![\w:])", npu):
            return Platform("ascend", "a3", f"Ascend 910C (A3), {shown} NPU(s) from npu-smi", count)
        if re.search(r"910B", npu):
            return Platform("ascend", "a2", f"Ascend 910B (A2), {shown} NPU(s) from npu-smi", count)
        return Platform("ascend", "unknown", "npu-smi answered but the chip is neither 910B nor 910_93", count)
    gpus = probe.run(["nvidia-smi", "-L"])
    if gpus:
        # `nvidia-smi -L` lists MIG instances indented under their GPU; count GPUs only.
        names = [line.split(":", 1)[1].split("(")[0].strip() for line in gpus.splitlines() if line.startswith("GPU ")]
        return Platform("cuda", "dev", f"CUDA, {len(names)} GPU(s): {', '.join(sorted(set(names)))}")
    return Platform("cpu", "dev", "CPU only (no npu-smi, no nvidia-smi)")


# --- rules ---------------------------------------------------------------------------------------

EXPECT_NPUS_ENV = "VERL_NPU_EXPECT_NPUS"
MOUNT_NPUS = (
    "give the container the NPUs (/dev/davinci*, /dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc), the host "
    "driver (/usr/local/Ascend/driver) and npu-smi (/usr/local/sbin/npu-smi): on Kubernetes through the "
    "huawei.com/ascend-* resource and hostPath mounts (for Kubernetes-mode runners, in the runner's pod template: "
    "docker `options:` are ignored there); with docker, --device and -v"
)


def check_expected_npus(probe: Probe, plat: Platform) -> list[Finding]:
    """Inside a job that expects NPUs (``VERL_NPU_EXPECT_NPUS``), a node without them is a failure, not "CPU only".

    verl's vLLM rollout on NPU runs ``npu-smi`` with no fallback, so its absence fails the job later anyway.
    """
    raw = probe.env.get(EXPECT_NPUS_ENV, "").strip()
    if not raw:
        return []
    if not raw.isdigit() or int(raw) < 1:
        return [
            Finding(
                "platform.expected-npus", FAIL, f"{EXPECT_NPUS_ENV}={raw!r} is not a positive integer",
                f"set {EXPECT_NPUS_ENV} to the NPUs the job needs on this node (8 on A2, 16 on A3), or unset it",
            )
        ]  # fmt: skip
    expected = int(raw)
    if plat.kind != "ascend":
        where = probe.which("npu-smi")
        seen = (
            "npu-smi is not on PATH"
            if where is None
            else f"{where} is there but `npu-smi info` failed or printed no NPU table"
        )
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({EXPECT_NPUS_ENV}), but {seen}; the node looks like {plat.detail}",
                MOUNT_NPUS,
            )
        ]  # fmt: skip
    if plat.devices is None or plat.devices < expected:
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({EXPECT_NPUS_ENV}), npu-smi lists {plat.devices or 'none'}",
                "request all of the node's NPUs for the job (huawei.com/ascend-* limit, runner label) and check "
                "`npu-smi info` for NPUs in a bad state",
            )
        ]  # fmt: skip
    return [Finding("platform.expected-npus", OK, f"{plat.devices} NPUs, {expected} expected")]


def check_platform(probe: Probe, stack: Stack, plat: Platform, target: str, built: dict | None) -> list[Finding]:
    if plat.target == "unknown":
        return [Finding("platform", FAIL, plat.detail, "report `npu-smi info` output; pass the target explicitly")]
    findings = [Finding("platform", OK, f"{plat.detail}; expected stack: target {target}")]
    if built is not None and built["target"] != plat.target:
        status = WARN if plat.kind != "ascend" else FAIL
        findings.append(
            Finding(
                "platform.image",
                status,
                f"this environment was built for target {built['target']} but the node is {plat.target}",
                f"use the verl-npu image built for {plat.target} (docker/Dockerfile.{plat.target})"
                if plat.target in NPU_TARGETS
                else "expected when inspecting an Ascend image on a non-Ascend machine",
            )
        )
    return findings


def check_versions(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    findings = []
    for dist, expected in sorted(stack.expected_versions(target).items()):
        copies = probe.distributions.get(_canonical(dist), [])
        fix = f"pip install '{dist}=={expected}'  (or rerun: bash install.sh --target {target})"
        if not copies:
            findings.append(Finding(f"version.{dist}", FAIL, f"not installed; manifest pins {expected}", fix))
            continue
        versions = sorted({v for v, _ in copies})
        if len(copies) > 1:
            where = "; ".join(f"{v} at {loc}" for v, loc in copies)
            findings.append(
                Finding(
                    f"version.{dist}",
                    FAIL,
                    f"{len(copies)} copies installed: {where}",
                    f"pip uninstall -y {dist}; {fix}",
                )
            )
        elif not build_manifest.same_version(versions[0], expected):
            findings.append(Finding(f"version.{dist}", FAIL, f"installed {versions[0]}, manifest pins {expected}", fix))
        else:
            findings.append(Finding(f"version.{dist}", OK, f"{versions[0]} (manifest {expected})"))
    return findings


def check_build_manifest(probe: Probe, stack: Stack, target: str, built: dict | None) -> list[Finding]:
    path = probe.build_manifest_path
    if built is None:
        return [
            Finding(
                "build-manifest",
                WARN,
                "no build manifest found (this environment was not installed by install.sh)",
                f"bash install.sh --target {target}, or set {build_manifest.ENV_VAR} to the image's file",
            )
        ]
    findings = []
    current_sha = hashlib.sha256(stack.path.read_bytes()).hexdigest()
    if built.get("stack_manifest_sha256") != current_sha:
        findings.append(
            Finding(
                "build-manifest.stack",
                WARN,
                f"{path} was built from a different stack.toml than the installed verl_npu carries",
                "rebuild the image (or rerun install.sh) from this checkout",
            )
        )
    drifted = []
    for dist, record in sorted(built.get("versions", {}).items()):
        now = probe.version(dist)
        if now is not None and record.get("installed") and now != record["installed"]:
            drifted.append(f"{dist}: built {record['installed']}, now {now}")
    if drifted:
        findings.append(
            Finding(
                "build-manifest.drift",
                FAIL,
                "packages changed after the build: " + "; ".join(drifted),
                "do not pip install over the image; rebuild it or rerun install.sh",
            )
        )
    unverified = [
        f"{name}={rec['resolved_commit'][:12]}"
        for name, rec in sorted(built.get("git", {}).items())
        if not rec.get("verified")
    ]
    if unverified:
        findings.append(
            Finding(
                "build-manifest.unverified",
                WARN,
                "commits resolved at build time, not pinned: " + ", ".join(unverified),
                "review them and pin them in verl_npu/stack.toml",
            )
        )
    git_lines = ", ".join(f"{n}={r['resolved_commit'][:12]}" for n, r in sorted(built.get("git", {}).items()))
    findings.insert(
        0,
        Finding(
            "build-manifest",
            OK,
            f"{path}: target {built['target']}, built {built.get('built_at', '?')}"
            + (f"; {git_lines}" if git_lines else ""),
        ),
    )
    return findings


def _read_version_file(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^\s*(?:Version|version)\s*=\s*([0-9][0-9A-Za-z.\-]*)", text, flags=re.M)
    return match.group(1) if match else None


def check_cann(probe: Probe, stack: Stack, plat: Platform, target: str) -> list[Finding]:
    if target not in NPU_TARGETS:
        return [Finding("cann", OK, "not needed on this platform")]
    findings = []
    home = probe.env.get("ASCEND_TOOLKIT_HOME") or probe.env.get("ASCEND_HOME_PATH")
    set_env = probe.ascend_root / "ascend-toolkit" / "set_env.sh"
    if not home:
        findings.append(
            Finding(
                "cann.env",
                FAIL,
                "CANN environment not set (ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH empty): "
                "torch_npu cannot load libhccl.so",
                f"source {set_env}  (the verl-npu image's entrypoint does this)",
            )
        )
    else:
        findings.append(Finding("cann.env", OK, f"ASCEND_TOOLKIT_HOME={home}"))
    expected = stack.chips[target].cann_version
    cann = None
    if home:
        for candidate in (Path(home) / "version.cfg", Path(home) / "compiler" / "version.info"):
            cann = cann or _read_version_file(candidate)
    driver = _read_version_file(probe.ascend_root / "driver" / "version.info")
    if cann is None:
        findings.append(
            Finding("cann.version", WARN if home else FAIL, "CANN version unreadable", f"install CANN {expected}")
        )
    elif _release(cann) != _release(expected):
        findings.append(
            Finding(
                "cann.version", FAIL, f"CANN {cann}, manifest expects {expected}", f"use the CANN {expected} base image"
            )
        )
    else:
        findings.append(Finding("cann.version", OK, f"CANN {cann}"))
    if plat.kind == "ascend":
        if driver is None:
            findings.append(
                Finding(
                    "cann.driver",
                    FAIL,
                    f"NPU driver version unreadable ({probe.ascend_root}/driver/version.info)",
                    "mount the host driver into the container: -v /usr/local/Ascend/driver:/usr/local/Ascend/driver",
                )
            )
        else:
            findings.append(
                Finding(
                    "cann.driver", OK, f"driver {driver} with CANN {cann or '?'} (check Ascend's compatibility table)"
                )
            )
    return findings


def check_torch_pairing(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    torch = probe.version("torch")
    npu = probe.version("torch-npu")
    if npu is None:
        if target in NPU_TARGETS:
            return [Finding("torch.pairing", FAIL, "torch_npu is not installed", f"bash install.sh --target {target}")]
        return [Finding("torch.pairing", OK, "torch_npu not installed (not needed on this platform)")]
    if torch is None:
        return [Finding("torch.pairing", FAIL, f"torch_npu {npu} installed without torch", "bash install.sh")]
    if _release(torch) != _release(npu):
        pinned = stack.packages["torch"].version
        return [
            Finding(
                "torch.pairing",
                FAIL,
                f"torch {torch} with torch_npu {npu}: "
                f"torch_npu {_release(npu)}.x only works with torch {_release(npu)}",
                f"pip install 'torch=={pinned}' 'torch-npu=={stack.packages['torch-npu'].version}'",
            )
        ]
    return [Finding("torch.pairing", OK, f"torch {torch} with torch_npu {npu}")]


def check_triton(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    mainline = probe.version("triton")
    ascend = probe.version("triton-ascend")
    if ascend is None:
        if target in NPU_TARGETS:
            return [Finding("triton", FAIL, "triton-ascend is not installed", f"bash install.sh --target {target}")]
        return [Finding("triton", OK, f"mainline triton {mainline}" if mainline else "no triton installed")]
    if mainline is not None:
        return [
            Finding(
                "triton",
                FAIL,
                f"mainline triton {mainline} shadows triton-ascend {ascend}: both install the `triton` package",
                "pip uninstall -y triton && pip install --force-reinstall --no-deps "
                f"'triton-ascend=={stack.packages['triton-ascend'].version}'",
            )
        ]
    return [Finding("triton", OK, f"triton-ascend {ascend}")]


def check_patches(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    """Each build-time patch is still applied to the installed copy of its package."""
    findings = []
    for pkg in stack.packages_for(target):
        for rel in pkg.patches:
            check = f"patch.{pkg.name}"
            patch = REPO_ROOT / rel
            if not patch.is_file() or shutil.which("git") is None:
                findings.append(Finding(check, WARN, f"cannot verify {rel} (patch file or git missing here)"))
                continue
            touched = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
            top = touched[0].split("/", 1)[0] if touched else pkg.name
            # A package's origin is .../site-packages/top/__init__.py; a namespace package's is the dir.
            roots = [
                str(Path(origin).parent.parent if origin.endswith(".py") else Path(origin).parent)
                for origin in probe.module_locations(top)
            ]
            if not roots:
                findings.append(
                    Finding(check, FAIL, f"{pkg.name} is not installed, so {rel} is not applied", "bash install.sh")
                )
                continue
            done = subprocess.run(
                ["git", "apply", "--reverse", "--check", str(patch)],
                cwd=roots[0],
                env={**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(roots[0]).parent)},
                capture_output=True,
                check=False,
            )
            if done.returncode == 0:
                findings.append(Finding(check, OK, f"{Path(rel).name} applied in {roots[0]}"))
            else:
                findings.append(
                    Finding(
                        check,
                        FAIL,
                        f"{Path(rel).name} is not applied to {pkg.name} in {roots[0]} (reinstalled from PyPI?)",
                        f"rerun install.sh (it builds {pkg.requirement} from source with the patch)",
                    )
                )
    return findings


def check_modules(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    findings = []
    megatron = probe.module_locations("megatron.core")
    if not megatron:
        findings.append(
            Finding(
                "module.megatron.core", FAIL, "megatron.core is not importable", f"bash install.sh --target {target}"
            )
        )
    elif len(megatron) > 1:
        findings.append(
            Finding(
                "module.megatron.core",
                FAIL,
                f"two copies of Megatron on sys.path: {'; '.join(megatron)} "
                "(the first wins, patches may hit the other)",
                "uninstall all but one: pip uninstall megatron-core, and remove Megatron-LM checkouts from PYTHONPATH",
            )
        )
    else:
        findings.append(Finding("module.megatron.core", OK, megatron[0]))

    for module, owner in (("megatron_adaptor", "megatron-adaptor"), ("transformer_engine", "transformer-engine-npu")):
        where = probe.module_locations(module)
        if target in NPU_TARGETS:
            if not where:
                findings.append(
                    Finding(
                        f"module.{module}",
                        FAIL,
                        f"{module} not importable ({owner} missing)",
                        f"bash install.sh --target {target}",
                    )
                )
            elif len(where) > 1:
                findings.append(
                    Finding(
                        f"module.{module}",
                        FAIL,
                        f"several copies: {'; '.join(where)}",
                        "keep only the one from install.sh",
                    )
                )
            else:
                findings.append(Finding(f"module.{module}", OK, where[0]))
        else:
            findings.append(Finding(f"module.{module}", OK, where[0] if where else "not installed (Ascend only)"))
    nvidia_te = [
        d for d in ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12") if probe.version(d)
    ]
    if target in NPU_TARGETS and nvidia_te:
        findings.append(
            Finding(
                "module.transformer_engine",
                FAIL,
                f"NVIDIA TransformerEngine ({', '.join(nvidia_te)}) "
                "collides with TransformerEngineNPU's `transformer_engine`",
                f"pip uninstall -y {' '.join(nvidia_te)}",
            )
        )
    return findings


def check_external_modules(probe: Probe, target: str) -> list[Finding]:
    value = probe.env.get("VERL_USE_EXTERNAL_MODULES", "")
    modules = [m.strip() for m in value.split(",") if m.strip()]
    fix = f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}  (set in the verl-npu images)"
    if LAYER_MODULE not in modules:
        status = FAIL if target in NPU_TARGETS else WARN
        shown = value if value else "unset"
        return [
            Finding(
                "verl.external-modules",
                status,
                f"VERL_USE_EXTERNAL_MODULES is {shown}: verl will not load the NPU layer",
                fix,
            )
        ]
    missing = [m for m in modules if not probe.module_locations(m)]
    if missing:
        return [
            Finding(
                "verl.external-modules",
                FAIL,
                f"VERL_USE_EXTERNAL_MODULES names modules that do not import: {', '.join(missing)} "
                "(`import verl` will fail)",
                "install them or remove them from VERL_USE_EXTERNAL_MODULES",
            )
        ]
    return [Finding("verl.external-modules", OK, value)]


def check_allocator_env(probe: Probe, target: str) -> list[Finding]:
    """PYTORCH_NPU_ALLOC_CONF with expandable segments stops vLLM's sleep mode (verl's default rollout)."""
    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS

    value = probe.env.get(ALLOC_CONF_VARIABLE)
    if value is None or EXPANDABLE_SEGMENTS not in value:
        shown = "unset" if value is None else f"={value}"
        return [Finding("env.npu-alloc-conf", OK, f"{ALLOC_CONF_VARIABLE} {shown}")]
    return [
        Finding(
            "env.npu-alloc-conf",
            FAIL if target in NPU_TARGETS else WARN,
            f"{ALLOC_CONF_VARIABLE}={value}: vllm-ascend's CaMemAllocator (vLLM sleep mode, verl's default "
            "rollout.enable_sleep_mode=True) asserts that it does not contain "
            f"{EXPANDABLE_SEGMENTS}, so the rollout cannot start",
            f"unset {ALLOC_CONF_VARIABLE} (the verl-npu images do not set it), or run the rollout with "
            "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        )
    ]


def check_glm52_rollout_patch(probe: Probe, target: str) -> list[Finding]:
    """verl 0.9.1's vllm-ascend 0.23 fixes for GLM-5.2 RL weight updates are opt-in (VERL_VLLM_ASCEND_GLM52_PATCH).

    Without them a GLM-5.2 rollout on Ascend disposes SFA's kv_b_proj after the first load (later weight
    syncs cannot rebuild the absorbed weights) and scores the indexer without its scale. Only a warning: other
    models do not need the patch, and verl applies it to every vLLM rollout once it is on.
    """
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE

    value = probe.env.get(GLM52_PATCH_VARIABLE)
    shown = "unset" if value is None else f"={value}"
    if target not in NPU_TARGETS:
        return [Finding("env.glm52-rollout-patch", OK, f"{GLM52_PATCH_VARIABLE} {shown} (vllm-ascend only)")]
    if value is not None and value.strip().lower() in GLM52_PATCH_ON_VALUES:  # verl's own test of the value
        return [Finding("env.glm52-rollout-patch", OK, f"{GLM52_PATCH_VARIABLE}={value}: verl's GLM-5.2 fixes are on")]
    return [
        Finding(
            "env.glm52-rollout-patch",
            WARN,
            f"{GLM52_PATCH_VARIABLE} {shown}: GLM-5.2 RL with vLLM rollouts on Ascend needs verl's vllm-ascend 0.23 "
            "fixes for weight updates (SFA keeps kv_b_proj, indexer weight scale, residual add, sleep and wake-up), "
            f"which verl applies only when it is {'/'.join(GLM52_PATCH_ON_VALUES)}",
            f"export {GLM52_PATCH_VARIABLE}=1 for GLM-5.2 (examples/glm5_2/glm5_2.env sets it; verl-npu forwards it "
            "to the Ray workers)",
        )
    ]


def _component_root(probe: Probe, import_name: str) -> Path | None:
    locations = probe.module_locations(import_name)
    if not locations:
        return None
    origin = Path(locations[0])
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


def check_contracts(probe: Probe, target: str, registry: Sequence[Any] | None = None) -> list[Finding]:
    """The recorded facts about MindSpeed, vllm-ascend, torch-npu and vLLM (``registry``, default: all
    of verl_npu.contracts), against the sources installed where the probe looks."""
    from verl_npu import contracts
    from verl_npu.contracts.verify import IMPORT_NAMES, verify

    registry = contracts.ALL if registry is None else registry
    roots = {c: _component_root(probe, IMPORT_NAMES[c]) for c in contracts.COMPONENTS}
    present = [c for c, root in roots.items() if root is not None]
    absent = [c for c in contracts.COMPONENTS if c not in present]
    findings = []
    if absent:
        status = FAIL if target in NPU_TARGETS else OK
        detail = f"{', '.join(absent)} not installed" + ("" if status == FAIL else " (Ascend only)")
        fix = f"bash install.sh --target {target}" if status == FAIL else ""
        findings.append(Finding("contracts.installed", status, detail, fix))
    failed = [r for r in verify(registry, roots, components=present) if not r.ok]
    for result in failed:
        findings.append(
            Finding(
                f"contracts.{result.contract.id}",
                FAIL,
                f"{result.contract.component}: {result.contract.where}: {result.detail}",
                "the installed source is not the pinned one: rebuild the image, or review the change "
                "(docs/ascend_contracts.md)",
            )
        )
    if present and not failed:
        checked = sum(c.component in present for c in registry)
        findings.append(Finding("contracts", OK, f"{checked} recorded facts hold in {', '.join(present)}"))
    return findings


def check_system(probe: Probe, target: str) -> list[Finding]:
    findings = []
    try:
        st = os.statvfs(probe.shm_path)
        shm = st.f_blocks * st.f_frsize
    except OSError:
        shm = None
    if shm is None:
        findings.append(
            Finding(
                "system.shm",
                FAIL,
                f"{probe.shm_path} is missing",
                "run the container with --shm-size=64g (or --ipc=host); on Kubernetes mount an emptyDir with "
                "medium: Memory at /dev/shm",
            )
        )
    elif shm < GIB:
        findings.append(
            Finding(
                "system.shm",
                FAIL,
                f"{probe.shm_path} is {shm / GIB:.2f} GiB: Ray object store and collective buffers need more",
                "docker run --shm-size=64g (or --ipc=host); on Kubernetes an emptyDir with medium: Memory and "
                "sizeLimit 64Gi or more at /dev/shm",
            )
        )
    elif probe.mem_total_bytes and shm < 0.1 * probe.mem_total_bytes:
        findings.append(
            Finding(
                "system.shm",
                WARN,
                f"{probe.shm_path} is {shm / GIB:.1f} GiB, under 10% of {probe.mem_total_bytes / GIB:.0f} GiB RAM",
                "docker run --shm-size=<30% of RAM>",
            )
        )
    else:
        findings.append(Finding("system.shm", OK, f"{probe.shm_path} {shm / GIB:.1f} GiB"))

    nofile = probe.rlimits.get("nofile")
    if nofile is not None:
        soft = nofile[0]
        if soft != resource.RLIM_INFINITY and soft < 4096:
            findings.append(
                Finding(
                    "system.nofile",
                    FAIL,
                    f"open files limit {soft}",
                    "ulimit -n 1048576 (docker: --ulimit nofile=1048576:1048576)",
                )
            )
        elif soft != resource.RLIM_INFINITY and soft < 65536:
            findings.append(
                Finding(
                    "system.nofile",
                    WARN,
                    f"open files limit {soft} (Ray with many workers wants >= 65536)",
                    "ulimit -n 1048576",
                )
            )
        else:
            findings.append(
                Finding(
                    "system.nofile", OK, f"open files limit {'unlimited' if soft == resource.RLIM_INFINITY else soft}"
                )
            )
    memlock = probe.rlimits.get("memlock")
    if memlock is not None:
        soft = memlock[0]
        if soft == resource.RLIM_INFINITY:
            findings.append(Finding("system.memlock", OK, "locked memory unlimited"))
        else:
            status = WARN if target in NPU_TARGETS else OK
            detail = f"locked memory limit {soft // 1024} KiB"
            if status == WARN:
                detail += " (pinned host buffers for offload and HCCL need it unlimited)"
            findings.append(
                Finding("system.memlock", status, detail, "docker run --ulimit memlock=-1:-1" if status == WARN else "")
            )
    return findings


def probe_layer(probe: Probe, target: str, *, ray: bool = True) -> tuple[dict | None, list[Finding]]:
    """Start Python the way a trainer does (``import verl``) and, with Ray, a worker from it.

    Returns what ``verl_npu.layer_probe`` saw, or None and the failure.
    """
    if importlib.util.find_spec("verl") is None:
        return None, [Finding("layer.process", FAIL, "verl is not installed", f"bash install.sh --target {target}")]
    want_ray = ray and importlib.util.find_spec("ray") is not None
    argv = [sys.executable, "-m", "verl_npu.layer_probe", *(["--ray"] if want_ray else [])]
    fix = "run: python -m verl_npu.layer_probe"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=dict(probe.env), timeout=600, check=False)
    except subprocess.TimeoutExpired:
        return None, [Finding("layer.process", FAIL, "probing the layer timed out after 600 s", fix)]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, [Finding("layer.process", FAIL, f"`import verl` failed: {last}", fix)]
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None, [Finding("layer.process", FAIL, "the layer probe printed no JSON report", fix)]
    return report, []


def check_layer(probe: Probe, target: str, *, ray: bool = True, report: dict | None = None) -> list[Finding]:
    """The runtime layer in a fresh process and a Ray worker (``report``: an earlier :func:`probe_layer` result)."""
    if report is None:
        report, failed = probe_layer(probe, target, ray=ray)
        if report is None:
            return failed
    findings = []
    proc = report["process"]
    if proc["active"]:
        counts: dict[str, int] = {}
        for status in proc["patches"].values():
            counts[status] = counts.get(status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        findings.append(Finding("layer.process", OK, f"active after `import verl` on {proc['platform']} ({summary})"))
    else:
        status = FAIL if target in NPU_TARGETS else WARN
        findings.append(
            Finding(
                "layer.process",
                status,
                "`import verl` does not load verl_npu.megatron_adaptor",
                f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}",
            )
        )
    worker = report.get("ray_worker")
    if worker is None:
        findings.append(Finding("layer.ray-worker", OK, "not checked (Ray not installed or --no-ray)"))
    elif worker["active"] and worker["forwarded"]:
        findings.append(Finding("layer.ray-worker", OK, "active in a Ray worker; runtime env forwards the layer"))
    else:
        status = FAIL if target in NPU_TARGETS or proc["active"] else WARN
        detail = "a Ray worker " + ("loads" if worker["active"] else "does not load") + " the layer; the runtime env "
        detail += (
            "forwards it"
            if worker["forwarded"]
            else "does not forward VERL_USE_EXTERNAL_MODULES (workers on other nodes miss it)"
        )
        findings.append(Finding("layer.ray-worker", status, detail, f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}"))
    return findings


# --- driver --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
    platform: Platform
    target: str
    findings: list[Finding]
    layer: dict | None = None  # what verl_npu.layer_probe saw (process and Ray worker), when it ran

    @property
    def failed(self) -> bool:
        return any(f.status == FAIL for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": dataclasses.asdict(self.platform),
            "target": self.target,
            "ok": not self.failed,
            "findings": [dataclasses.asdict(f) for f in self.findings],
        }


def diagnose(
    probe: Probe | None = None,
    stack: Stack | None = None,
    *,
    layer: bool = False,
    ray: bool = True,
    contracts: Sequence[Any] | None = None,
) -> Report:
    probe = probe or Probe.current()
    stack = stack or load_stack()
    plat = detect_platform(probe)
    built = None
    findings: list[Finding] = []
    if probe.build_manifest_path is not None:
        try:
            built = build_manifest.read(probe.build_manifest_path)
        except build_manifest.BuildManifestError as exc:
            findings.append(Finding("build-manifest", FAIL, str(exc), "rerun install.sh"))
    target = plat.target if plat.target != "unknown" else (built or {}).get("target", "dev")
    if plat.kind != "ascend" and built is not None and built.get("target") in NPU_TARGETS:
        target = built["target"]  # inspecting an Ascend image without NPUs: check it as built
    findings += check_platform(probe, stack, plat, target, built)
    findings += check_expected_npus(probe, plat)
    findings += check_versions(probe, stack, target)
    if not any(f.check == "build-manifest" for f in findings):
        findings += check_build_manifest(probe, stack, target, built)
    findings += check_cann(probe, stack, plat, target)
    findings += check_torch_pairing(probe, stack, target)
    findings += check_triton(probe, stack, target)
    findings += check_patches(probe, stack, target)
    findings += check_modules(probe, stack, target)
    findings += check_external_modules(probe, target)
    findings += check_allocator_env(probe, target)
    findings += check_glm52_rollout_patch(probe, target)
    findings += check_contracts(probe, target, contracts)
    findings += check_system(probe, target)
    if probe.network is not None and (target in NPU_TARGETS or plat.kind == "ascend"):
        findings += probe.network(probe.env)
    elif probe.network is not None:
        findings.append(Finding("network", OK, "not checked on a dev target: HCCL and the cluster's interfaces "
                                "matter on Ascend nodes (python -m verl_npu.cluster.network check)"))  # fmt: skip
    seen = None
    if layer:
        seen, failed = probe_layer(probe, target, ray=ray)
        findings += failed if seen is None else check_layer(probe, target, report=seen)
    return Report(plat, target, findings, seen)
