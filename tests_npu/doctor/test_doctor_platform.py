"""The platform rules: the chip from npu-smi / nvidia-smi (verl_npu.stack.detect) against the image."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.doctor_env import (
    A2_CAPTURE,
    A2_X16_CAPTURE,
    A3_BUSY_CAPTURE,
    A3_CAPTURE,
    A3_OLD_CAPTURE,
    CAPTURES,
    NPU_SMI_A2,
    NPU_SMI_A3,
    NPU_SMI_UNKNOWN,
    NVIDIA_SMI,
    STACK,
    fake_run,
    make_probe,
    make_tree,
    npu_smi_capture,
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
    assert (plat.kind, plat.target, plat.devices, plat.cards) == ("ascend", "a2", 8, 8)
    assert plat.detail == "Atlas A2 (910B3), 8 NPUs, from npu-smi 24.1.0.3"
    assert probe.run.calls == [["npu-smi", "info"]]  # npu-smi answered: nvidia-smi is not asked


def test_platform_a3_counts_both_dies_of_each_card(tmp_path: Path) -> None:
    """A real A3 node (npu-smi 25.2.1): 8 cards named Ascend910, each printed twice. It used to read as
    `unknown` (no "910_93" nor "A3" in the output) with 8 NPUs (unique NPU ids)."""
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target, plat.devices, plat.cards) == ("ascend", "a3", 16, 8)
    assert plat.detail == "Atlas A3 (Ascend910), 16 NPUs on 8 cards (two dies each), from npu-smi 25.2.1"
    finding = only(doctor.check_platform(probe, STACK, plat, "a3", None), "platform")
    assert finding.status == OK and finding.detail.endswith("expected stack: target a3")


@pytest.mark.parametrize(("capture", "expected"), sorted(CAPTURES.items()))
def test_every_capture_reads_as_the_machine_it_came_from(capture: str, expected: tuple[str, int, int]) -> None:
    plat = detect.detect_platform(fake_run(npu=npu_smi_capture(capture)))
    assert (plat.kind, plat.target, plat.devices, plat.cards, plat.problem) == ("ascend", *expected, None)


@pytest.mark.parametrize("capture", [A3_CAPTURE, A3_BUSY_CAPTURE, A3_OLD_CAPTURE])
def test_an_a3_table_lists_each_die_once_with_its_phy_id(capture: str) -> None:
    table = detect.read_npu_smi(npu_smi_capture(capture))
    assert table.id_column == "Phy-ID"
    assert sorted(c.device for c in table.chips) == list(range(16))  # /dev/davinci0..15
    assert [(c.npu, c.chip) for c in table.chips] == [(n, d) for n in range(8) for d in (0, 1)]
    assert {c.name for c in table.chips} == {"Ascend910"}


def test_the_process_table_of_a_busy_a3_node_is_not_read_as_npus() -> None:
    """Its rows ("| 0       0                 | 935440 |") have the NPU/chip shape but no Bus-Id."""
    text = npu_smi_capture(A3_BUSY_CAPTURE)
    assert "| 0       0                 | 935440        |" in text
    assert len(detect.read_npu_smi(text).chips) == 16


@pytest.mark.parametrize(("capture", "count"), [(A2_CAPTURE, 8), (A2_X16_CAPTURE, 16)])
def test_neither_a_b3_chip_nor_16_npus_makes_an_a3_node(capture: str, count: int) -> None:
    """910B3 chips run in A2 servers, and an x86 A2 node lists 16 910B2C chips: both stay a2."""
    table = detect.read_npu_smi(npu_smi_capture(capture))
    assert table.target()[0] == "a2" and len(table.chips) == table.cards == count
    assert table.id_column is None and {c.chip for c in table.chips} == {0}


def test_platform_unknown_chip_fails_and_names_the_option_that_exists(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_UNKNOWN)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target, plat.devices) == ("ascend", "unknown", 6)
    assert plat.problem is None
    finding = only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform")
    assert finding.status == FAIL
    assert "310P3 chips: neither Atlas A2 (910B* chips) nor Atlas A3" in finding.detail
    # the fix names an option doctor has (it once said "pass the target explicitly", which doctor could not take)
    assert "`verl-npu doctor --target a2`" in finding.fix and "docs/hardware_detection.md" in finding.fix
    assert "npu-smi info" in finding.fix
    report = doctor.diagnose(probe, STACK)
    assert report.failed and report.target == "dev"
    assert only(report.findings, "platform").status == FAIL


def test_target_option_checks_an_unrecognised_node_as_told_with_a_warning(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_UNKNOWN)
    report = doctor.diagnose(probe, STACK, target="a3")
    assert report.target == "a3"
    finding = only(report.findings, "platform")
    assert finding.status == WARN and "checked as target a3 because --target says so" in finding.detail
    assert "npu-smi info" in finding.fix


def test_target_option_that_contradicts_npu_smi_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3)
    report = doctor.diagnose(probe, STACK, target="a2")
    finding = only(report.findings, "platform")
    assert finding.status == FAIL and "--target a2, but npu-smi shows an a3 node" in finding.detail
    same = doctor.diagnose(probe, STACK, target="a3")
    assert only(same.findings, "platform").status == OK
    assert only(same.findings, "platform").detail.endswith("expected stack: target a3 (--target)")


def test_target_option_is_a2_or_a3(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="doctor checks a2 or a3"):
        doctor.diagnose(make_probe([make_tree(tmp_path / "sp", {})]), STACK, target="dev")


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


@pytest.mark.parametrize(("capture", "expected"), sorted(CAPTURES.items()))
def test_detect_target_answers_each_capture(capture: str, expected: tuple[str, int, int]) -> None:
    run = fake_run(npu=npu_smi_capture(capture))
    if expected[0] == "unknown":
        with pytest.raises(detect.UnknownChipError, match=r"310P3 chips: neither .*--target a2 or --target a3"):
            detect.detect_target(run, _which(True))
    else:
        assert detect.detect_target(run, _which(True)) == expected[0]


def test_detect_target_without_npu_smi_is_dev_and_does_not_run_it() -> None:
    run = fake_run(npu=NPU_SMI_A3)
    assert detect.detect_target(run, _which(False)) == "dev"
    assert run.calls == []


def test_detect_target_refuses_a_failing_npu_smi() -> None:
    with pytest.raises(detect.UnknownChipError, match=r"`npu-smi info` failed"):
        detect.detect_target(fake_run(npu=None), _which(True))


def test_doctor_and_the_runtime_use_the_one_detector() -> None:
    from verl_npu import platform

    assert doctor.Platform is detect.Platform
    assert platform.npu_device_files is detect.npu_device_files and platform.KINDS == ("ascend", "cuda", "cpu")
