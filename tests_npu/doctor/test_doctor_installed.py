"""The rules on installed sources: one copy of each module, build-time patches, contracts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from support.doctor_env import (
    DEV_MODULES,
    NPU_MODULES,
    NPU_SMI_A3,
    STACK,
    dev_versions,
    install_patched_packages,
    make_probe,
    make_tree,
    only,
    synthetic_contracts,
    write_patch_side,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, Finding
from verl_npu.stack import REPO_ROOT


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
