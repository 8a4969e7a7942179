"""The CANN rules: the toolkit's environment and version, the NPU driver."""

from __future__ import annotations

from pathlib import Path

from support.doctor_env import (
    CANN,
    NPU_SMI_A3,
    STACK,
    make_cann,
    make_probe,
    make_tree,
    only,
    statuses,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, Finding, Probe


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
