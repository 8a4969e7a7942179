"""Every rule of ``verl-npu doctor`` fires, driven by constructed environments.

Each test builds what the doctor looks at: fake site-packages trees (``*.dist-info/METADATA`` plus
package directories), canned ``npu-smi`` / ``nvidia-smi`` output, a fake Ascend install root,
build-manifest JSON files and resource limits. The rules themselves are never mocked; the only
stand-in is ``os.statvfs`` for a tiny /dev/shm.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

from verl_npu import doctor
from verl_npu.doctor import FAIL, GIB, OK, WARN, Finding, Probe
from verl_npu.stack import REPO_ROOT, build_manifest, load_stack

STACK = load_stack()
STACK_SHA = hashlib.sha256(STACK.path.read_bytes()).hexdigest()
CANN = STACK.chips["a3"].cann_version  # 9.1.0
TORCH = STACK.packages["torch"].version  # 2.10.0
TORCH_NPU = STACK.packages["torch-npu"].version  # 2.10.0.post4
TRITON_ASCEND = STACK.packages["triton-ascend"].version
LAYER = doctor.LAYER_MODULE
UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)

# Modules a complete install provides, per target.
DEV_MODULES = ["megatron/core", f"{LAYER.replace('.', '/')}.py"]
NPU_MODULES = [*DEV_MODULES, "megatron_adaptor", "transformer_engine", "mindspeed", "vllm_ascend", "torch_npu", "vllm"]

# --- canned command output -------------------------------------------------------------------------

_NPU_SMI_HEAD = """\
+-------------------------------------------------------------------------------------------+
| npu-smi 25.3.rc1                 Version: 25.3.rc1                                        |
+---------------------------+---------------+-----------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)     Hugepages-Usage(page) |
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)   |
+===========================+===============+===============================================+
"""
_NPU_SMI_SEP = "+===========================+===============+===============================================+"


def npu_smi_table(chip: str, count: int, bus_ids: Sequence[str] | None = None) -> str:
    """`npu-smi info` as it prints ``count`` NPUs named ``chip`` (one chip row each)."""
    bus_ids = bus_ids or [f"0000:{0xC1 + i:02X}:00.0" for i in range(count)]
    rows = []
    for i in range(count):
        rows.append(f"| {i:<5} {chip:<19} | OK            | 93.6        40          0    / 0          |")
        rows.append(f"| 0                         | {bus_ids[i]}  | 0           0    / 0          3396 / 65536 |")
        rows.append(_NPU_SMI_SEP)
    return _NPU_SMI_HEAD + "\n".join(rows) + "\n"


NPU_SMI_A2 = npu_smi_table("910B3", 8)
NPU_SMI_A3 = npu_smi_table("Ascend910_9392", 16)
NPU_SMI_UNKNOWN = npu_smi_table("310P3", 2)
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


# --- constructed environments ----------------------------------------------------------------------


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

        monkeypatch.setattr(doctor.os, "statvfs", fake)

    return install


# --- 1. platform -----------------------------------------------------------------------------------


def test_platform_cpu(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})])
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("cpu", "dev")
    assert probe.run.calls == [["npu-smi", "info"], ["nvidia-smi", "-L"]]
    finding = only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform")
    assert finding.status == OK
    assert "CPU only" in finding.detail and "target dev" in finding.detail


def test_platform_cuda(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], gpus=NVIDIA_SMI)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("cuda", "dev")
    assert "2 GPU(s)" in plat.detail and "NVIDIA H100 80GB HBM3" in plat.detail
    assert "UUID" not in plat.detail


def test_platform_a2(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A2, gpus=NVIDIA_SMI)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("ascend", "a2")
    assert "910B" in plat.detail and "8 NPU(s)" in plat.detail
    assert probe.run.calls == [["npu-smi", "info"]]  # npu-smi answered: nvidia-smi is not asked


def test_platform_a3(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("ascend", "a3")
    assert "A3" in plat.detail and "16 NPU(s)" in plat.detail


def test_platform_a3_short_chip_name(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=npu_smi_table("910_93", 2))
    assert doctor.detect_platform(probe).target == "a3"


def test_platform_a2_whose_bus_id_reads_a3(tmp_path: Path) -> None:
    """A PCI Bus-Id 0000:A3:00.0 on a 910B node must not make it an A3 node."""
    table = npu_smi_table("910B3", 2, bus_ids=["0000:A3:00.0", "0000:A4:00.0"])
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=table)
    assert doctor.detect_platform(probe).target == "a2"


def test_platform_unknown_chip_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_UNKNOWN)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("ascend", "unknown")
    finding = only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform")
    assert finding.status == FAIL
    assert "neither 910B nor 910_93" in finding.detail
    assert "npu-smi info" in finding.fix
    report = doctor.diagnose(probe, STACK)
    assert report.failed and report.target == "dev"
    assert only(report.findings, "platform").status == FAIL


def test_platform_image_built_for_another_target(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", {})
    manifest = write_build_manifest(tmp_path / "bm.json", "a3")
    # An A3 image on an A2 node: fail, name both targets and the right Dockerfile.
    a2 = doctor.diagnose(make_probe([tree], npu=NPU_SMI_A2, build_manifest_path=manifest), STACK)
    image = only(a2.findings, "platform.image")
    assert image.status == FAIL
    assert "built for target a3 but the node is a2" in image.detail
    assert "docker/Dockerfile.a2" in image.fix
    # The same image inspected on a CPU box: only a warning, and it is checked as the a3 it was built for.
    cpu = doctor.diagnose(make_probe([tree], build_manifest_path=manifest), STACK)
    assert cpu.target == "a3"
    assert only(cpu.findings, "platform.image").status == WARN


# --- 2. versions -----------------------------------------------------------------------------------


def test_versions_all_match(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions())])
    findings = doctor.check_versions(probe, STACK, "dev")
    assert {f.check for f in findings} == {f"version.{d}" for d in STACK.expected_versions("dev")}
    assert all(f.status == OK for f in findings), findings
    assert only(findings, "version.torch").detail == f"{TORCH} (manifest {TORCH})"


def test_versions_wrong_torch_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(torch="2.9.0"))])
    findings = doctor.check_versions(probe, STACK, "dev")
    torch = only(findings, "version.torch")
    assert torch.status == FAIL
    assert "installed 2.9.0" in torch.detail and TORCH in torch.detail
    assert "torch==2.10.0" in torch.fix and "--target dev" in torch.fix
    assert [f.check for f in findings if f.status == FAIL] == ["version.torch"]


def test_versions_missing_package_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(mbridge=None))])
    mbridge = only(doctor.check_versions(probe, STACK, "dev"), "version.mbridge")
    pinned = STACK.packages["mbridge"].version
    assert mbridge.status == FAIL
    assert mbridge.detail == f"not installed; manifest pins {pinned}"
    assert f"mbridge=={pinned}" in mbridge.fix


def test_versions_npu_target_needs_npu_packages(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions())])
    findings = doctor.check_versions(probe, STACK, "a3")
    npu = only(findings, "version.torch-npu")
    assert npu.status == FAIL and f"torch-npu=={TORCH_NPU}" in npu.fix and "--target a3" in npu.fix
    assert only(findings, "version.vllm").status == FAIL


def test_versions_two_copies_fail(tmp_path: Path) -> None:
    one = make_tree(tmp_path / "one", dev_versions())
    two = make_tree(tmp_path / "two", {"torch": TORCH})
    probe = make_probe([one, two])
    torch = only(doctor.check_versions(probe, STACK, "dev"), "version.torch")
    assert torch.status == FAIL
    assert torch.detail.startswith("2 copies installed")
    assert str(one) in torch.detail and str(two) in torch.detail
    assert torch.fix.startswith("pip uninstall -y torch;") and "torch==2.10.0" in torch.fix


def test_versions_same_tree_listed_twice_is_one_copy(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", dev_versions())
    probe = make_probe([tree, tree])
    assert only(doctor.check_versions(probe, STACK, "dev"), "version.torch").status == OK


def test_versions_local_label_matches(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(torch="2.10.0+cpu"))])
    torch = only(doctor.check_versions(probe, STACK, "dev"), "version.torch")
    assert torch.status == OK
    assert "2.10.0+cpu" in torch.detail


def test_versions_names_are_canonicalised(tmp_path: Path) -> None:
    """A dist-info that spells the name torch_npu still counts as torch-npu."""
    versions = a3_versions()
    versions["torch_npu"] = versions.pop("torch-npu")
    probe = make_probe([make_tree(tmp_path / "sp", versions)])
    assert only(doctor.check_versions(probe, STACK, "a3"), "version.torch-npu").status == OK


# --- 3. build manifest -----------------------------------------------------------------------------


def test_build_manifest_absent_warns(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)])
    report = doctor.diagnose(probe, STACK)
    finding = only(report.findings, "build-manifest")
    assert finding.status == WARN
    assert "no build manifest" in finding.detail
    assert "install.sh --target dev" in finding.fix and build_manifest.ENV_VAR in finding.fix


def test_build_manifest_matching_is_ok(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "a3", verified=True)
    probe = make_probe([make_tree(tmp_path / "sp", a3_versions())], npu=NPU_SMI_A3, build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "a3", build_manifest.read(manifest))
    assert [f.check for f in findings] == ["build-manifest"]
    assert findings[0].status == OK
    assert str(manifest) in findings[0].detail and "target a3" in findings[0].detail
    assert f"mindspeed={STACK.git['mindspeed'].commit[:12]}" in findings[0].detail


def test_build_manifest_drift_fails(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "dev")
    tree = make_tree(tmp_path / "sp", dev_versions(torch="2.9.0", transformers="5.10.3"))
    probe = make_probe([tree], build_manifest_path=manifest)
    drift = only(
        doctor.check_build_manifest(probe, STACK, "dev", build_manifest.read(manifest)),
        "build-manifest.drift",
    )
    assert drift.status == FAIL
    assert "torch: built 2.10.0, now 2.9.0" in drift.detail
    assert "transformers: built 5.10.4, now 5.10.3" in drift.detail
    assert "verl:" not in drift.detail
    assert "rebuild" in drift.fix


def test_build_manifest_unverified_commits_warn(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "a3")  # as stack.toml pins them
    probe = make_probe([make_tree(tmp_path / "sp", a3_versions())], npu=NPU_SMI_A3, build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "a3", build_manifest.read(manifest))
    unverified = only(findings, "build-manifest.unverified")
    assert unverified.status == WARN
    for comp in STACK.git_for("a3"):
        commit = hashlib.sha1(comp.name.encode()).hexdigest()[:12] if not comp.verified else comp.commit[:12]
        assert (f"{comp.name}={commit}" in unverified.detail) is (not comp.verified), comp.name
    assert "stack.toml" in unverified.fix
    assert only(findings, "build-manifest").status == OK


def test_build_manifest_other_stack_warns(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "dev", sha="0" * 64)
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions())], build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "dev", build_manifest.read(manifest))
    stack = only(findings, "build-manifest.stack")
    assert stack.status == WARN
    assert str(manifest) in stack.detail and "different stack.toml" in stack.detail
    assert "rebuild" in stack.fix


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not valid JSON"), ('{"target": "dev", "git": {}}', "key 'versions' is missing")],
)
def test_build_manifest_malformed_fails(tmp_path: Path, content: str, message: str) -> None:
    manifest = tmp_path / "build-manifest.json"
    manifest.write_text(content)
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)], build_manifest_path=manifest)
    report = doctor.diagnose(probe, STACK)
    finding = only(report.findings, "build-manifest")
    assert finding.status == FAIL
    assert str(manifest) in finding.detail and message in finding.detail
    assert "rerun install.sh" in finding.fix
    assert report.failed
    assert not [f for f in report.findings if f.check.startswith("build-manifest.")]


def test_build_manifest_named_but_missing_fails(tmp_path: Path) -> None:
    manifest = tmp_path / "nowhere" / "build-manifest.json"
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)], build_manifest_path=manifest)
    finding = only(doctor.diagnose(probe, STACK).findings, "build-manifest")
    assert finding.status == FAIL
    assert "not found" in finding.detail and build_manifest.ENV_VAR in finding.detail


# --- 4. CANN -----------------------------------------------------------------------------------------


def _a3_plat(probe: Probe) -> doctor.Platform:
    plat = doctor.detect_platform(probe)
    assert plat.target == "a3"
    return plat


def test_cann_not_sourced_fails(tmp_path: Path) -> None:
    root, _ = make_cann(tmp_path / "Ascend")
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3, ascend_root=root)
    findings = doctor.check_cann(probe, STACK, _a3_plat(probe), "a3")
    env = only(findings, "cann.env")
    assert env.status == FAIL
    assert "ASCEND_TOOLKIT_HOME" in env.detail
    assert env.fix.startswith(f"source {root / 'ascend-toolkit' / 'set_env.sh'}")
    version = only(findings, "cann.version")
    assert version.status == FAIL and f"install CANN {CANN}" in version.fix


def test_cann_wrong_version_fails(tmp_path: Path) -> None:
    root, home = make_cann(tmp_path / "Ascend", version="8.3.RC1")
    probe = make_probe(
        [make_tree(tmp_path / "sp", {})],
        npu=NPU_SMI_A3,
        ascend_root=root,
        env={"ASCEND_TOOLKIT_HOME": str(home)},
    )
    findings = doctor.check_cann(probe, STACK, _a3_plat(probe), "a3")
    assert only(findings, "cann.env").status == OK
    version = only(findings, "cann.version")
    assert version.status == FAIL
    assert version.detail == f"CANN 8.3.RC1, manifest expects {CANN}"
    assert f"CANN {CANN} base image" in version.fix


def test_cann_version_from_compiler_version_info(tmp_path: Path) -> None:
    root, home = make_cann(tmp_path / "Ascend", version=None)
    (home / "compiler").mkdir()
    (home / "compiler" / "version.info").write_text(f"Version={CANN}\n")
    probe = make_probe(
        [make_tree(tmp_path / "sp", {})],
        npu=NPU_SMI_A3,
        ascend_root=root,
        env={"ASCEND_HOME_PATH": str(home)},
    )
    version = only(doctor.check_cann(probe, STACK, _a3_plat(probe), "a3"), "cann.version")
    assert version.status == OK and CANN in version.detail


def test_cann_driver_missing_fails(tmp_path: Path) -> None:
    root, home = make_cann(tmp_path / "Ascend", driver=None)
    probe = make_probe(
        [make_tree(tmp_path / "sp", {})],
        npu=NPU_SMI_A3,
        ascend_root=root,
        env={"ASCEND_TOOLKIT_HOME": str(home)},
    )
    findings = doctor.check_cann(probe, STACK, _a3_plat(probe), "a3")
    driver = only(findings, "cann.driver")
    assert driver.status == FAIL
    assert f"{root}/driver/version.info" in driver.detail
    assert "-v /usr/local/Ascend/driver:/usr/local/Ascend/driver" in driver.fix
    assert only(findings, "cann.version").status == OK


def test_cann_all_good(tmp_path: Path) -> None:
    root, home = make_cann(tmp_path / "Ascend")
    probe = make_probe(
        [make_tree(tmp_path / "sp", {})],
        npu=NPU_SMI_A3,
        ascend_root=root,
        env={"ASCEND_TOOLKIT_HOME": str(home)},
    )
    findings = doctor.check_cann(probe, STACK, _a3_plat(probe), "a3")
    assert statuses(findings) == {"cann.env": OK, "cann.version": OK, "cann.driver": OK}
    assert only(findings, "cann.driver").detail.startswith(f"driver 25.3.rc1 with CANN {CANN}")


def test_cann_not_needed_on_dev(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})])
    findings = doctor.check_cann(probe, STACK, doctor.detect_platform(probe), "dev")
    assert findings == [Finding("cann", OK, "not needed on this platform")]


# --- 5. torch / torch_npu pairing ------------------------------------------------------------------


def test_torch_pairing_mismatch_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"torch": "2.11.0", "torch-npu": "2.10.0.post4"})])
    pairing = only(doctor.check_torch_pairing(probe, STACK, "a3"), "torch.pairing")
    assert pairing.status == FAIL
    assert "torch 2.11.0 with torch_npu 2.10.0.post4" in pairing.detail
    assert f"'torch=={TORCH}'" in pairing.fix and f"'torch-npu=={TORCH_NPU}'" in pairing.fix


def test_torch_pairing_match_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"torch": "2.10.0+cpu", "torch-npu": TORCH_NPU})])
    pairing = only(doctor.check_torch_pairing(probe, STACK, "a3"), "torch.pairing")
    assert pairing.status == OK
    assert pairing.detail == f"torch 2.10.0+cpu with torch_npu {TORCH_NPU}"


def test_torch_pairing_without_torch_npu(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"torch": TORCH})])
    npu = only(doctor.check_torch_pairing(probe, STACK, "a2"), "torch.pairing")
    assert npu.status == FAIL and "torch_npu is not installed" in npu.detail and "--target a2" in npu.fix
    assert only(doctor.check_torch_pairing(probe, STACK, "dev"), "torch.pairing").status == OK


def test_torch_pairing_torch_npu_without_torch(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"torch-npu": TORCH_NPU})])
    pairing = only(doctor.check_torch_pairing(probe, STACK, "a3"), "torch.pairing")
    assert pairing.status == FAIL and "without torch" in pairing.detail


# --- 6. triton -------------------------------------------------------------------------------------


def test_triton_both_installed_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"triton": "3.6.0", "triton-ascend": TRITON_ASCEND})])
    triton = only(doctor.check_triton(probe, STACK, "a3"), "triton")
    assert triton.status == FAIL
    assert "mainline triton 3.6.0 shadows triton-ascend" in triton.detail
    assert triton.fix.startswith("pip uninstall -y triton ")
    assert f"triton-ascend=={TRITON_ASCEND}" in triton.fix


def test_triton_ascend_alone_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"triton-ascend": TRITON_ASCEND})])
    triton = only(doctor.check_triton(probe, STACK, "a3"), "triton")
    assert (triton.status, triton.detail) == (OK, f"triton-ascend {TRITON_ASCEND}")


def test_triton_ascend_missing_on_npu_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {"triton": "3.6.0"})])
    assert only(doctor.check_triton(probe, STACK, "a3"), "triton").status == FAIL
    dev = only(doctor.check_triton(probe, STACK, "dev"), "triton")
    assert (dev.status, dev.detail) == (OK, "mainline triton 3.6.0")


# --- 7. modules ------------------------------------------------------------------------------------


def test_modules_two_megatron_copies_fail(tmp_path: Path) -> None:
    one = make_tree(tmp_path / "one", {}, ["megatron/core"])
    two = make_tree(tmp_path / "two", {}, ["megatron/core"])
    probe = make_probe([one, two])
    megatron = only(doctor.check_modules(probe, STACK, "dev"), "module.megatron.core")
    assert megatron.status == FAIL
    assert "two copies" in megatron.detail
    assert str(one / "megatron" / "core") in megatron.detail and str(two / "megatron" / "core") in megatron.detail
    assert "pip uninstall megatron-core" in megatron.fix


def test_modules_megatron_missing_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, ["megatron"])])  # megatron without core
    megatron = only(doctor.check_modules(probe, STACK, "dev"), "module.megatron.core")
    assert megatron.status == FAIL and "not importable" in megatron.detail


def test_modules_single_megatron_ok(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", {}, DEV_MODULES)
    megatron = only(doctor.check_modules(make_probe([tree]), STACK, "dev"), "module.megatron.core")
    assert megatron.status == OK
    assert megatron.detail == str(tree / "megatron" / "core" / "__init__.py")


def test_modules_adaptor_missing_on_a3_fails(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", {}, ["megatron/core", "transformer_engine"])
    findings = doctor.check_modules(make_probe([tree], npu=NPU_SMI_A3), STACK, "a3")
    adaptor = only(findings, "module.megatron_adaptor")
    assert adaptor.status == FAIL
    assert "megatron_adaptor not importable (megatron-adaptor missing)" in adaptor.detail
    assert "install.sh --target a3" in adaptor.fix
    assert only(findings, "module.transformer_engine").status == OK
    # The same tree on a dev box: the Ascend-only module is not needed.
    dev = only(doctor.check_modules(make_probe([tree]), STACK, "dev"), "module.megatron_adaptor")
    assert (dev.status, dev.detail) == (OK, "not installed (Ascend only)")


def test_modules_nvidia_transformer_engine_on_a3_fails(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", {"transformer-engine": "2.9.0"}, NPU_MODULES)
    findings = doctor.check_modules(make_probe([tree], npu=NPU_SMI_A3), STACK, "a3")
    te = only(findings, "module.transformer_engine", FAIL)
    assert "NVIDIA TransformerEngine (transformer-engine)" in te.detail
    assert te.fix == "pip uninstall -y transformer-engine"
    # The dist is fine on a dev box.
    assert FAIL not in {f.status for f in doctor.check_modules(make_probe([tree]), STACK, "dev")}


def test_modules_two_adaptor_copies_fail(tmp_path: Path) -> None:
    one = make_tree(tmp_path / "one", {}, NPU_MODULES)
    two = make_tree(tmp_path / "two", {}, ["megatron_adaptor"])
    adaptor = only(doctor.check_modules(make_probe([one, two]), STACK, "a3"), "module.megatron_adaptor")
    assert adaptor.status == FAIL and "several copies" in adaptor.detail and str(two) in adaptor.detail


# --- 8. VERL_USE_EXTERNAL_MODULES ------------------------------------------------------------------


def test_external_modules_unset_on_dev_warns(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)])
    finding = only(doctor.check_external_modules(probe, "dev"), "verl.external-modules")
    assert finding.status == WARN
    assert "VERL_USE_EXTERNAL_MODULES is unset" in finding.detail
    assert finding.fix.startswith(f"export VERL_USE_EXTERNAL_MODULES={LAYER}")


def test_external_modules_unset_on_a3_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, NPU_MODULES)], npu=NPU_SMI_A3)
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL
    assert f"VERL_USE_EXTERNAL_MODULES={LAYER}" in finding.fix


def test_external_modules_without_the_layer_fails_on_a3(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, NPU_MODULES)], env={"VERL_USE_EXTERNAL_MODULES": "mindspeed"})
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL and "VERL_USE_EXTERNAL_MODULES is mindspeed" in finding.detail


def test_external_modules_layer_not_importable_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, ["megatron/core"])], env={"VERL_USE_EXTERNAL_MODULES": LAYER})
    finding = only(doctor.check_external_modules(probe, "dev"), "verl.external-modules")
    assert finding.status == FAIL
    assert f"do not import: {LAYER}" in finding.detail


def test_external_modules_extra_module_not_importable_fails(tmp_path: Path) -> None:
    env = {"VERL_USE_EXTERNAL_MODULES": f"{LAYER}, no_such_module"}
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)], env=env)
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL
    assert "do not import: no_such_module" in finding.detail and LAYER not in finding.detail.split(":")[1]


def test_external_modules_set_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)], env={"VERL_USE_EXTERNAL_MODULES": LAYER})
    for target in ("dev", "a3"):
        finding = only(doctor.check_external_modules(probe, target), "verl.external-modules")
        assert (finding.status, finding.detail) == (OK, LAYER)


# --- 9. system -------------------------------------------------------------------------------------


def test_shm_too_small_fails(tmp_path: Path, shm_size) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm_size(shm, 64 * 1024**2)  # docker's default 64 MiB
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=shm)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == FAIL
    assert f"{shm} is 0.06 GiB" in finding.detail
    assert "--shm-size=64g" in finding.fix


def test_shm_missing_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=tmp_path / "no-shm")
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == FAIL and "no-shm is missing" in finding.detail and "--shm-size" in finding.fix


def test_shm_small_for_the_ram_warns(tmp_path: Path, shm_size) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm_size(shm, 2 * GIB)
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=shm, mem_total_bytes=1024 * GIB)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == WARN and "2.0 GiB, under 10% of 1024 GiB RAM" in finding.detail


def test_shm_real_directory(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=tmp_path)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == (OK if size >= GIB else FAIL)
    assert str(tmp_path) in finding.detail


@pytest.mark.parametrize(
    ("soft", "status", "text"),
    [
        (1024, FAIL, "open files limit 1024"),
        (20000, WARN, "open files limit 20000 (Ray"),
        (1048576, OK, "open files limit 1048576"),
        (resource.RLIM_INFINITY, OK, "open files limit unlimited"),
    ],
)
def test_nofile(tmp_path: Path, soft: int, status: str, text: str) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], rlimits={"nofile": (soft, resource.RLIM_INFINITY)})
    finding = only(doctor.check_system(probe, "dev"), "system.nofile")
    assert finding.status == status
    assert text in finding.detail
    if status != OK:
        assert "ulimit -n 1048576" in finding.fix


def test_memlock_limited_on_a3_warns(tmp_path: Path) -> None:
    limited = {"memlock": (64 * 1024, 64 * 1024)}
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3, rlimits=limited)
    finding = only(doctor.check_system(probe, "a3"), "system.memlock")
    assert finding.status == WARN
    assert "locked memory limit 64 KiB" in finding.detail
    assert finding.fix == "docker run --ulimit memlock=-1:-1"
    dev = only(doctor.check_system(probe, "dev"), "system.memlock")
    assert (dev.status, dev.fix) == (OK, "")


def test_memlock_unlimited_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], rlimits={"memlock": UNLIMITED})
    finding = only(doctor.check_system(probe, "a3"), "system.memlock")
    assert (finding.status, finding.detail) == (OK, "locked memory unlimited")


# --- 10. diagnose end to end -----------------------------------------------------------------------


def _a3_node(tmp_path: Path, shm_size, **override: str | None) -> Probe:
    tree = install_patched_packages(make_tree(tmp_path / "sp", a3_versions(**override), NPU_MODULES), "a3")
    root, home = make_cann(tmp_path / "Ascend")
    shm = tmp_path / "shm"
    shm.mkdir()
    shm_size(shm, 64 * GIB)  # stands in for a properly sized /dev/shm
    manifest = write_build_manifest(tmp_path / "build-manifest.json", "a3")
    return make_probe(
        [tree],
        npu=NPU_SMI_A3,
        # a GLM-5.2 node: verl's vllm-ascend fixes on, as examples/glm5_2/glm5_2.env sets them
        env={"ASCEND_TOOLKIT_HOME": str(home), "VERL_USE_EXTERNAL_MODULES": LAYER, "VERL_VLLM_ASCEND_GLM52_PATCH": "1"},
        shm_path=shm,
        mem_total_bytes=256 * GIB,
        rlimits={"nofile": (1048576, 1048576), "memlock": UNLIMITED},
        build_manifest_path=manifest,
        ascend_root=root,
    )


def synthetic_contracts(tree: Path):
    """One contract per component on a file written into ``tree``: the real contracts name upstream sources
    this repository does not hold (tests_npu/test_contracts.py checks those against the real artifacts)."""
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


def diagnose_node(probe: Probe) -> doctor.Report:
    return doctor.diagnose(probe, STACK, contracts=synthetic_contracts(Path(probe.sys_path[0])))


def test_contracts_hold_fail_when_drifted_and_are_not_needed_on_a_dev_box(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp", {}, NPU_MODULES)
    registry = synthetic_contracts(tree)
    probe = make_probe([tree], npu=NPU_SMI_A3)
    (finding,) = doctor.check_contracts(probe, "a3", registry)
    assert (finding.check, finding.status) == ("contracts", OK) and "4 recorded facts hold" in finding.detail
    (tree / "vllm_ascend" / "facts.py").write_text("def fact():\n    return 'something else'\n")
    (drifted,) = doctor.check_contracts(probe, "a3", registry)
    assert (drifted.check, drifted.status) == ("contracts.vllm-ascend-fact", FAIL)
    assert "the name: no longer contains \"'vllm-ascend'\"" in drifted.detail and "rebuild the image" in drifted.fix
    bare = make_probe([make_tree(tmp_path / "bare", {}, DEV_MODULES)])
    (absent,) = doctor.check_contracts(bare, "a3", registry)
    assert absent.status == FAIL and "mindspeed, vllm-ascend, torch-npu, vllm not installed" in absent.detail
    (dev,) = doctor.check_contracts(bare, "dev", registry)
    assert dev.status == OK and "(Ascend only)" in dev.detail


@pytest.mark.parametrize(("target", "status"), [("a3", FAIL), ("dev", WARN)])
def test_expandable_segments_are_flagged_for_vllm_sleep_mode(tmp_path: Path, target, status) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    (finding,) = doctor.check_allocator_env(probe, target)
    assert finding.status == status and "CaMemAllocator" in finding.detail and "enable_sleep_mode=False" in finding.fix
    plain = make_probe([make_tree(tmp_path / "sp2", {})], env={"PYTORCH_NPU_ALLOC_CONF": "page_size:1g"})
    assert doctor.check_allocator_env(plain, target)[0].status == OK


@pytest.mark.parametrize("value", [None, "0", "false", "on", ""])
def test_an_ascend_node_without_verls_glm52_rollout_fixes_is_warned(tmp_path: Path, value) -> None:
    env = {} if value is None else {"VERL_VLLM_ASCEND_GLM52_PATCH": value}
    probe = make_probe([make_tree(tmp_path / "sp", {})], env=env)
    (finding,) = doctor.check_glm52_rollout_patch(probe, "a3")
    assert (finding.check, finding.status) == ("env.glm52-rollout-patch", WARN)
    assert "GLM-5.2 RL with vLLM rollouts on Ascend" in finding.detail and "1/true/yes" in finding.detail
    assert "examples/glm5_2/glm5_2.env sets it" in finding.fix and "VERL_VLLM_ASCEND_GLM52_PATCH=1" in finding.fix
    (dev,) = doctor.check_glm52_rollout_patch(probe, "dev")  # no vllm-ascend on a dev box
    assert dev.status == OK


@pytest.mark.parametrize("value", ["1", "true", "YES", " yes "])
def test_an_ascend_node_with_verls_glm52_rollout_fixes_is_ok(tmp_path: Path, value) -> None:
    """The values verl's patch accepts (stripped, lowercased: verl/utils/vllm/npu_vllm_patch.py)."""
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={"VERL_VLLM_ASCEND_GLM52_PATCH": value})
    for target in ("a2", "a3"):
        (finding,) = doctor.check_glm52_rollout_patch(probe, target)
        assert finding.status == OK and "fixes are on" in finding.detail


def test_diagnose_warns_an_a3_node_without_verls_glm52_rollout_fixes(tmp_path: Path, shm_size) -> None:
    probe = _a3_node(tmp_path, shm_size)
    probe.env = {k: v for k, v in probe.env.items() if k != "VERL_VLLM_ASCEND_GLM52_PATCH"}
    report = diagnose_node(probe)
    assert not report.failed
    assert only(report.findings, "env.glm52-rollout-patch").status == WARN


def test_diagnose_consistent_a3_node_passes(tmp_path: Path, shm_size) -> None:
    report = diagnose_node(_a3_node(tmp_path, shm_size))
    assert report.target == "a3" and report.platform.kind == "ascend"
    assert not report.failed, [f for f in report.findings if f.status == FAIL]
    # The only warning: stack.toml still has UNVERIFIED git commits, recorded as resolved at build time.
    warned = [f.check for f in report.findings if f.status == WARN]
    assert warned == (["build-manifest.unverified"] if any(not g.verified for g in STACK.git_for("a3")) else [])
    checks = {f.check for f in report.findings}
    assert {f"version.{d}" for d in STACK.expected_versions("a3")} <= checks
    assert {
        "platform",
        "build-manifest",
        "cann.env",
        "cann.version",
        "cann.driver",
        "torch.pairing",
    } <= checks
    assert {
        "triton",
        "module.megatron.core",
        "module.megatron_adaptor",
        "module.transformer_engine",
    } <= checks
    assert {"verl.external-modules", "system.shm", "system.nofile", "system.memlock"} <= checks
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["ok"] is True and doc["target"] == "a3"


def test_diagnose_a3_node_with_one_wrong_version_fails(tmp_path: Path, shm_size) -> None:
    report = diagnose_node(_a3_node(tmp_path, shm_size, transformers="5.10.3"))
    assert report.failed
    failed = {f.check for f in report.findings if f.status == FAIL}
    assert failed == {"version.transformers", "build-manifest.drift"}
    assert "transformers==5.10.4" in only(report.findings, "version.transformers").fix
    assert report.to_dict()["ok"] is False


# --- 11. the command line --------------------------------------------------------------------------


def _verl_npu() -> list[str]:
    script = Path(sys.executable).parent / "verl-npu"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "verl_npu.cli"]


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES" and not k.startswith("ASCEND_")}
    env.pop(build_manifest.ENV_VAR, None)
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


def _raise_nofile() -> None:
    """In the child: lift the soft open-files limit to the hard one, as `ulimit -n` would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1048576 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _skip_unless_dev_host() -> None:
    """The CLI reads this machine's platform and limits; the dev-tree cases need a non-Ascend host."""
    if shutil.which("npu-smi"):
        pytest.skip("this host has npu-smi: the CLI would check it as an Ascend node, not as dev")


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_verl_npu(), "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
        preexec_fn=_raise_nofile,
    )


def test_cli_wrong_torch_exits_1(tmp_path: Path) -> None:
    _skip_unless_dev_host()
    tree = install_patched_packages(make_tree(tmp_path / "sp", dev_versions(torch="2.9.0"), DEV_MODULES), "dev")
    env = _cli_env(**{build_manifest.ENV_VAR: str(write_build_manifest(tmp_path / "bm.json", "dev"))})
    done = _run_cli(["--json", "--site-packages", str(tree)], env)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is False and report["target"] == "dev"
    torch = [f for f in report["findings"] if f["check"] == "version.torch"]
    assert len(torch) == 1 and torch[0]["status"] == FAIL
    assert "installed 2.9.0" in torch[0]["detail"] and "torch==2.10.0" in torch[0]["fix"]
    failed = {f["check"] for f in report["findings"] if f["status"] == FAIL and not f["check"].startswith("system.")}
    assert failed == {"version.torch", "build-manifest.drift"}


def test_cli_consistent_dev_tree_exits_0(tmp_path: Path) -> None:
    _skip_unless_dev_host()
    try:
        st = os.statvfs("/dev/shm")
        shm_ok = st.f_blocks * st.f_frsize >= GIB
    except OSError:
        shm_ok = False
    if not shm_ok:
        pytest.skip("this host's /dev/shm is under 1 GiB, so system.shm fails regardless of the tree")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this host's hard open-files limit is {hard}, so system.nofile fails regardless of the tree")
    tree = install_patched_packages(make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES), "dev")
    manifest = write_build_manifest(tmp_path / "bm.json", "dev")
    done = _run_cli(["--json", "--site-packages", str(tree)], _cli_env(**{build_manifest.ENV_VAR: str(manifest)}))
    report = json.loads(done.stdout)
    assert [f for f in report["findings"] if f["status"] == FAIL] == []
    assert done.returncode == 0, done.stderr
    assert report["ok"] is True and report["target"] == "dev"
    assert {f["check"]: f["status"] for f in report["findings"]}["version.torch"] == OK
    # --build-manifest overrides the environment variable: a malformed file now fails the run.
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    args = ["--json", "--site-packages", str(tree), "--build-manifest", str(bad)]
    overridden = _run_cli(args, _cli_env(**{build_manifest.ENV_VAR: str(manifest)}))
    assert overridden.returncode == 1
    finding = [f for f in json.loads(overridden.stdout)["findings"] if f["check"] == "build-manifest"]
    assert finding[0]["status"] == FAIL and "not valid JSON" in finding[0]["detail"]


def test_cli_table_on_this_machine(tmp_path: Path) -> None:
    if not (Path(sys.prefix) / build_manifest.FILENAME).is_file():
        pytest.skip(f"{sys.prefix} has no {build_manifest.FILENAME}: this venv was not made by install.sh")
    done = subprocess.run(
        [*_verl_npu(), "doctor"], capture_output=True, text=True, env=_cli_env(), timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target dev" in done.stdout
    assert "0 failed" in done.stdout


# --- build-time patches ----------------------------------------------------------------------------


def test_patch_applied_is_ok_and_missing_patch_fails(tmp_path: Path) -> None:
    def patch_findings(findings: Sequence[Finding]) -> list[Finding]:
        hits = [f for f in findings if f.check == "patch.mbridge"]
        assert len(hits) == len(STACK.packages["mbridge"].patches), "one finding per mbridge patch"
        return hits

    patched = install_patched_packages(make_tree(tmp_path / "patched", dev_versions()), "dev")
    for ok, rel in zip(patch_findings(doctor.check_patches(make_probe([patched]), STACK, "dev")),
                       STACK.packages["mbridge"].patches, strict=True):  # fmt: skip
        assert ok.status == OK and str(patched) in ok.detail and Path(rel).name in ok.detail

    pristine = make_tree(tmp_path / "pristine", dev_versions())
    for rel in STACK.packages["mbridge"].patches:
        write_patch_side(pristine, REPO_ROOT / rel, "old")
    for failed in patch_findings(doctor.check_patches(make_probe([pristine]), STACK, "dev")):
        assert failed.status == FAIL
        assert "is not applied to mbridge" in failed.detail and "mbridge==0.15.1" in failed.fix

    absent = patch_findings(doctor.check_patches(make_probe([make_tree(tmp_path / "none", {})]), STACK, "dev"))[0]
    assert absent.status == FAIL and "mbridge is not installed" in absent.detail
