"""Constructed environments for the doctor's tests (tests_npu/doctor/test_doctor*.py).

Each test builds what the doctor looks at: fake site-packages trees (``*.dist-info/METADATA`` plus
package directories), real ``npu-smi info`` captures (tests_npu/data/npu_smi/, sources in its
SOURCES.md), canned ``nvidia-smi`` output, a fake Ascend install root, build-manifest JSON files and
resource limits. The rules themselves are never mocked; the stand-ins are ``os.statvfs`` for a tiny
/dev/shm (the ``shm_size`` fixture) and an ``npu-smi`` on PATH that prints a capture (``install_npu_smi``).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest
from support.paths import DATA

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, WARN, Finding, Probe
from verl_npu.stack import REPO_ROOT, load_stack

STACK = load_stack()


STACK_SHA = hashlib.sha256(STACK.path.read_bytes()).hexdigest()


CANN = STACK.chips["a3"].cann_version  # 9.1.0


TORCH = STACK.packages["torch"].version  # 2.10.0


TORCH_NPU = STACK.packages["torch-npu"].version  # 2.10.0.post4


TRITON_ASCEND = STACK.packages["triton-ascend"].version


LAYER = doctor.LAYER_MODULE


UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)


DEV_MODULES = ["megatron/core", f"{LAYER.replace('.', '/')}.py"]


NPU_MODULES = [*DEV_MODULES, "megatron_adaptor", "transformer_engine", "mindspeed", "vllm_ascend", "torch_npu", "vllm"]


NPU_SMI_DATA = DATA / "npu_smi"


def npu_smi_capture(name: str) -> str:
    """A real `npu-smi info` capture from tests_npu/data/npu_smi/ (SOURCES.md names where each came from)."""
    return (NPU_SMI_DATA / name).read_text()


# Atlas A3: 8 cards of two dies, npu-smi 25.2.1 (vllm-project/vllm-ascend#4989)
A3_CAPTURE = "a3_25.2.1_vllm-ascend-4989.txt"
# Atlas A3 under load: the process table below lists "| 0       0 |"-shaped rows (vllm-project/vllm-ascend#3002)
A3_BUSY_CAPTURE = "a3_25.2.0_busy_vllm-ascend-3002.txt"
# Atlas A3, npu-smi 24.1.rc3.7 (vllm-project/vllm-ascend#2667)
A3_OLD_CAPTURE = "a3_24.1.rc3.7_vllm-ascend-2667.txt"
# Atlas A2 with 8 910B3 chips: a "B3" chip on an A2 node (vllm-project/vllm-ascend#3024)
A2_CAPTURE = "a2_910B3_24.1.0.3_vllm-ascend-3024.txt"
# Atlas A2 with 16 910B2C chips: 16 NPUs that are not an A3 node (vllm-project/vllm-ascend#621)
A2_X16_CAPTURE = "a2_910B2C_x16_24.1.rc2.2_vllm-ascend-621.txt"
# Atlas 300I Duo class 310P3 chips, which verl-npu has no stack for (vllm-project/vllm-ascend#2712)
UNKNOWN_CAPTURE = "310P3_25.2.0_vllm-ascend-2712.txt"
CAPTURES = {  # file -> (target, NPUs, cards) the capture shows
    A3_CAPTURE: ("a3", 16, 8),
    A3_BUSY_CAPTURE: ("a3", 16, 8),
    A3_OLD_CAPTURE: ("a3", 16, 8),
    A2_CAPTURE: ("a2", 8, 8),
    A2_X16_CAPTURE: ("a2", 16, 16),
    UNKNOWN_CAPTURE: ("unknown", 6, 6),
}


NPU_SMI_A2 = npu_smi_capture(A2_CAPTURE)


NPU_SMI_A3 = npu_smi_capture(A3_CAPTURE)


NPU_SMI_UNKNOWN = npu_smi_capture(UNKNOWN_CAPTURE)


def install_npu_smi(bin_dir: Path, capture: str | None, *, exit_code: int = 0, stderr: str = "") -> Path:
    """Put an ``npu-smi`` on PATH (``bin_dir``) that stands in for the driver's tool.

    It prints the capture ``capture`` (a file of tests_npu/data/npu_smi/) for `npu-smi info` and
    ``stderr`` then exits ``exit_code``; asked anything else, it exits 2 saying so, like a tool that
    does not know the option. Returns ``bin_dir``.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "npu-smi"
    shown = f"cat {shlex.quote(str(NPU_SMI_DATA / capture))}" if capture else ":"
    tool.write_text(
        "#!/bin/sh\n"
        "# stands in for the NPU driver's npu-smi: prints a real capture (tests_npu/data/SOURCES.md)\n"
        'if [ "$#" -ne 1 ] || [ "$1" != info ]; then echo "npu-smi stand-in: only \\`npu-smi info\\`" >&2; exit 2; fi\n'
        f"{shown}\n" + (f"printf '%s\\n' {shlex.quote(stderr)} >&2\n" if stderr else "") + f"exit {exit_code}\n"
    )
    tool.chmod(0o755)
    return bin_dir


NVIDIA_SMI = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5b1c1f3e-8a4d-4d0e-9a61-1c1b0f6c2e01)\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0c7d2a9b-3e5f-4b1a-8d2c-7f6e5d4c3b02)\n"
)


def fake_run(npu: str | None = None, gpus: str | None = None):
    """Stands in for running npu-smi / nvidia-smi; None means the command is absent."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> str | None:
        calls.append(list(argv))
        if list(argv) == ["npu-smi", "info"]:
            return npu
        if list(argv) == ["nvidia-smi", "-L"]:
            return gpus
        raise AssertionError(f"doctor ran an unexpected command: {argv}")

    run.calls = calls  # type: ignore[attr-defined]
    return run


def make_tree(root: Path, dists: Mapping[str, str], modules: Iterable[str] = ()) -> Path:
    """A directory that acts as site-packages.

    ``dists``: distribution name -> version, written as ``NAME-VERSION.dist-info/METADATA``.
    ``modules``: ``a/b`` makes packages ``a`` and ``a.b`` (``__init__.py`` each), ``a/b.py`` makes
    package ``a`` with module ``a.b``.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name, version in dists.items():
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for module in modules:
        parts = module.split("/")
        leaf_is_file = parts[-1].endswith(".py")
        packages = parts[:-1] if leaf_is_file else parts
        here = root
        for part in packages:
            here = here / part
            here.mkdir(exist_ok=True)
            (here / "__init__.py").touch()
        if leaf_is_file:
            (here / parts[-1]).write_text("")
    return root


def write_patch_side(root: Path, patch: Path, side: str) -> None:
    """Write the files a patch touches as their post-image (``side="new"``) or pre-image (``"old"``).

    Stands in for an installed package built with (new) or without (old) our build-time patch:
    each file holds the hunks' lines in order, which is all ``git apply --reverse --check`` reads.
    """
    keep = "+" if side == "new" else "-"
    current: list[str] | None = None
    files: dict[str, list[str]] = {}
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            current = files.setdefault(line[6:], [])
        elif line.startswith(("---", "diff ", "index ", "@@")) or current is None:
            continue
        elif line.startswith(" ") or line.startswith(keep):
            current.append(line[1:])
    for rel, lines in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")


def install_patched_packages(tree: Path, target: str) -> Path:
    for pkg in STACK.packages_for(target):
        for rel in pkg.patches:
            write_patch_side(tree, REPO_ROOT / rel, "new")
    return tree


def make_cann(
    root: Path, version: str | None = CANN, driver: str | None = "25.3.rc1", set_env: bool = True
) -> tuple[Path, Path]:
    """A fake /usr/local/Ascend; returns (ascend_root, toolkit home)."""
    home = root / "ascend-toolkit" / "latest"
    home.mkdir(parents=True)
    if set_env:
        (root / "ascend-toolkit" / "set_env.sh").write_text(f"export ASCEND_TOOLKIT_HOME={home}\n")
    if version is not None:
        (home / "version.cfg").write_text(f"# version: 1.0\nVersion={version}\n")
    if driver is not None:
        (root / "driver").mkdir()
        (root / "driver" / "version.info").write_text(f"Version={driver}\nascendhal_version=7.35.23\n")
    return root, home


def write_build_manifest(
    path: Path,
    target: str,
    installed: Mapping[str, str] | None = None,
    *,
    verified: bool | None = None,
    sha: str = STACK_SHA,
) -> Path:
    """A build manifest shaped like ``build_manifest.write`` output.

    ``verified``: None records each git component as stack.toml pins it (UNVERIFIED ones resolved at
    build time); True / False records every component as pinned / unverified.
    """
    expected = STACK.expected_versions(target)
    installed = dict(expected) if installed is None else installed
    git = {}
    for comp in STACK.git_for(target):
        resolved = comp.commit if comp.verified else hashlib.sha1(comp.name.encode()).hexdigest()
        is_verified = comp.verified if verified is None else verified
        git[comp.name] = {
            "url": comp.url,
            "ref": comp.ref,
            "pinned_commit": resolved if is_verified else "UNVERIFIED",
            "resolved_commit": resolved,
            "verified": is_verified,
        }
    doc = {
        "schema": 1,
        "target": target,
        "stack_manifest_sha256": sha,
        "python": "3.12.1",
        "arch": "aarch64",
        "versions": {d: {"expected": v, "installed": installed.get(d)} for d, v in sorted(expected.items())},
        "git": git,
        "built_at": "2026-01-01T00:00:00+00:00",
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def a3_versions(**override: str | None) -> dict[str, str]:
    versions = {**STACK.expected_versions("a3"), **override}
    return {k: v for k, v in versions.items() if v is not None}


def dev_versions(**override: str | None) -> dict[str, str]:
    versions = {**STACK.expected_versions("dev"), **override}
    return {k: v for k, v in versions.items() if v is not None}


def make_probe(
    trees: Sequence[Path],
    *,
    npu: str | None = None,
    gpus: str | None = None,
    env: Mapping[str, str] | None = None,
    shm_path: Path | None = None,
    mem_total_bytes: int | None = None,
    rlimits: Mapping[str, tuple[int, int]] | None = None,
    build_manifest_path: Path | None = None,
    ascend_root: Path | None = None,
) -> Probe:
    first = Path(trees[0]) if trees else Path("/nonexistent")
    return Probe(
        env=dict(env or {}),
        sys_path=[str(t) for t in trees],
        run=fake_run(npu, gpus),
        shm_path=shm_path or first,
        mem_total_bytes=mem_total_bytes,
        rlimits={"nofile": UNLIMITED, "memlock": UNLIMITED} if rlimits is None else rlimits,
        build_manifest_path=build_manifest_path,
        ascend_root=ascend_root or first.parent / "Ascend",
    )


def only(findings: Sequence[Finding], check: str, status: str | None = None) -> Finding:
    """The single finding with this check id (and status, when given)."""
    hits = [f for f in findings if f.check == check and (status is None or f.status == status)]
    assert len(hits) == 1, f"expected one {check!r} ({status}), got {hits} in {findings}"
    return hits[0]


def statuses(findings: Iterable[Finding]) -> dict[str, str]:
    """check id -> status; a check id may appear twice (module.transformer_engine): keep the worst."""
    rank = {OK: 0, WARN: 1, FAIL: 2}
    out: dict[str, str] = {}
    for f in findings:
        if f.check not in out or rank[f.status] > rank[out[f.check]]:
            out[f.check] = f.status
    return out


@pytest.fixture
def shm_size(monkeypatch: pytest.MonkeyPatch):
    """``shm_size(path, size)``: statvfs of ``path`` reports ``size`` bytes (stands in for /dev/shm)."""
    real = os.statvfs

    def install(path: Path, size: int) -> None:
        def fake(p):
            if Path(p) == Path(path):
                return types.SimpleNamespace(f_blocks=size // 4096, f_frsize=4096)
            return real(p)

        monkeypatch.setattr(os, "statvfs", fake)

    return install


def synthetic_contracts(tree: Path):
    """One contract per component on a file written into ``tree``: the real contracts name upstream sources
    this repository does not hold (tests_npu/contracts/test_contracts.py checks those against the real artifacts)."""
    from verl_npu.contracts.spec import Contract, Expect, fingerprint

    registry = []
    components = (
        ("mindspeed", "mindspeed"),
        ("vllm-ascend", "vllm_ascend"),
        ("torch-npu", "torch_npu"),
        ("vllm", "vllm"),
    )
    for component, package in components:
        source = f"def fact():\n    return {component!r}"
        (tree / package / "facts.py").write_text(source + "\n")
        registry.append(
            Contract(
                id=f"{component}-fact",
                component=component,
                path=f"{package}/facts.py",
                locator="python",
                symbol="fact",
                line=1,
                sha256=fingerprint(source),
                relied_on=f"{component} returns its name",
                used_by="tests",
                expects=(Expect(repr(component), "the name"),),
            )
        )
    return tuple(registry)
