"""The platform rules: the chip from npu-smi / nvidia-smi (verl_npu.stack.detect) against the image."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.doctor_env import (
    NPU_SMI_A2,
    NPU_SMI_A3,
    NPU_SMI_UNKNOWN,
    NVIDIA_SMI,
    STACK,
    fake_run,
    make_probe,
    make_tree,
    npu_smi_table,
    only,
    write_build_manifest,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, WARN
from verl_npu.stack import detect


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


# --- the one detector (verl_npu.stack.detect), as install.sh asks it -----------------------------------


def _which(present: bool):
    return lambda name: f"/usr/local/sbin/{name}" if present else None


@pytest.mark.parametrize(
    ("table", "target"),
    [
        (NPU_SMI_A2, "a2"),
        (NPU_SMI_A3, "a3"),
        (npu_smi_table("910_93", 2), "a3"),
        (npu_smi_table("910B3", 2, bus_ids=["0000:A3:00.0", "0000:A4:00.0"]), "a2"),
    ],
)
def test_detect_target_reads_the_chip_not_the_bus_id(table: str, target: str) -> None:
    assert detect.detect_target(fake_run(npu=table), _which(True)) == target


def test_detect_target_without_npu_smi_is_dev_and_does_not_run_it() -> None:
    run = fake_run(npu=NPU_SMI_A3)
    assert detect.detect_target(run, _which(False)) == "dev"
    assert run.calls == []


def test_detect_target_refuses_an_unknown_chip_or_a_failing_npu_smi() -> None:
    with pytest.raises(detect.UnknownChipError, match=r"neither 910B nor 910_93 .*chips listed: 310P3.*--target a2"):
        detect.detect_target(fake_run(npu=NPU_SMI_UNKNOWN), _which(True))
    with pytest.raises(detect.UnknownChipError, match=r"`npu-smi info` failed"):
        detect.detect_target(fake_run(npu=None), _which(True))


def test_doctor_and_the_runtime_use_the_one_detector() -> None:
    from verl_npu import platform

    assert doctor.Platform is detect.Platform
    assert platform.npu_device_files is detect.npu_device_files and platform.KINDS == ("ascend", "cuda", "cpu")
