"""The version rules: installed distributions against stack.toml, torch / torch_npu, triton."""

from __future__ import annotations

from pathlib import Path

from support.doctor_env import (
    STACK,
    TORCH,
    TORCH_NPU,
    TRITON_ASCEND,
    a3_versions,
    dev_versions,
    make_probe,
    make_tree,
    only,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK


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
