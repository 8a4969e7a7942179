"""An npu-smi that fails, hangs or prints garbage (issue 18): doctor fails naming it, install.sh stops in bounded
time, and neither leaves npu-smi's children behind.

The fake npu-smi is a real executable on PATH, run through verl_npu.stack.detect.run_command as on a node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.doctor_env import (
    A3_CAPTURE,
    NPU_SMI_A2,
    STACK,
    UNKNOWN_CAPTURE,
    install_npu_smi,
    make_probe,
    make_tree,
    npu_smi_capture,
    only,
)
from support.paths import REPO
from support.processes import gone_soon, grandchild, hanging_script

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, WARN
from verl_npu.doctor import report as doctor_report
from verl_npu.stack import detect

DCMI = "dcmi model initialized failed, because the device is used. ret is -8020"


def fake_npu_smi(bin_dir: Path, *, stdout: bytes = b"", stderr: str = "", code: int = 0) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "out.bin").write_bytes(stdout)
    script = bin_dir / "npu-smi"
    script.write_text(f"#!/bin/bash\ncat '{bin_dir / 'out.bin'}'\nprintf '%s\\n' '{stderr}' >&2\nexit {code}\n")
    script.chmod(0o755)
    return bin_dir


def real_probe(tmp_path: Path, bin_dir: Path, monkeypatch) -> doctor.Probe:
    """A probe that runs the npu-smi on PATH (the real runner), with an otherwise empty node."""
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    probe = make_probe([make_tree(tmp_path / "sp", {})])
    probe.run = detect.run_command
    return probe


def test_an_npu_smi_that_exits_255_is_a_failure_naming_it_its_code_and_stderr(tmp_path, monkeypatch):
    probe = real_probe(tmp_path, fake_npu_smi(tmp_path / "bin", stderr=DCMI, code=255), monkeypatch)
    plat = doctor.detect_platform(probe)
    assert (plat.kind, plat.target) == ("ascend", "unknown") and "CPU only" not in plat.detail
    finding = only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform")
    assert finding.status == FAIL
    assert "npu-smi" in finding.detail and "exited 255" in finding.detail and DCMI in finding.detail
    assert "driver" in finding.fix
    report = doctor.diagnose(probe, STACK)
    assert report.failed and only(report.findings, "platform").status == FAIL


def test_a_hanging_npu_smi_is_a_failure_naming_the_timeout_and_its_children_are_ended(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hanging_script(bin_dir / "npu-smi", tmp_path / "pid", ignore_term=True)
    monkeypatch.setenv(detect.TIMEOUT_ENV, "1")
    probe = real_probe(tmp_path, bin_dir, monkeypatch)
    started = time.monotonic()
    plat = doctor.detect_platform(probe)
    assert time.monotonic() - started < 10
    finding = only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform")
    assert finding.status == FAIL and "`npu-smi info` did not answer within 1 s" in finding.detail
    assert gone_soon(grandchild(tmp_path / "pid")), "npu-smi's child outlived the timeout"


@pytest.mark.parametrize(
    "output",
    [
        pytest.param(b"\xff\xfe\x00garbage\x80\n\x81", id="binary"),
        pytest.param(b"", id="empty"),
        pytest.param("| 0  910B3 | OK |".encode("utf-16"), id="utf-16"),
        pytest.param(b"Ascend 910B\n" + bytes(range(256)), id="chip-name-but-no-table"),
    ],
)
def test_undecodable_or_unparseable_output_is_a_failure_not_a_traceback(tmp_path, monkeypatch, output):
    probe = real_probe(tmp_path, fake_npu_smi(tmp_path / "bin", stdout=output), monkeypatch)
    plat = doctor.detect_platform(probe)
    assert plat.target == "unknown"
    assert only(doctor.check_platform(probe, STACK, plat, "dev", None), "platform").status == FAIL
    text = doctor_report.render(doctor.diagnose(probe, STACK), probe, STACK, layer_requested=False)
    assert "## NPUs" in text


def test_a_table_with_a_stray_undecodable_byte_still_reads(tmp_path, monkeypatch):
    output = NPU_SMI_A2.encode().replace(b"Power(W)", b"Power(\xff)")
    probe = real_probe(tmp_path, fake_npu_smi(tmp_path / "bin", stdout=output), monkeypatch)
    plat = doctor.detect_platform(probe)
    assert (plat.target, plat.devices) == ("a2", 8)
    assert only(doctor.check_platform(probe, STACK, plat, "a2", None), "platform").status == OK


def test_expected_npus_names_the_failing_npu_smi(tmp_path, monkeypatch):
    probe = real_probe(tmp_path, fake_npu_smi(tmp_path / "bin", stderr=DCMI, code=255), monkeypatch)
    plat = doctor.detect_platform(probe)
    probe.env = {doctor.EXPECT_NPUS_ENV: "8"}
    finding = only(doctor.check_expected_npus(probe, plat), "platform.expected-npus")
    assert finding.status == FAIL and "exited 255" in finding.detail and DCMI in finding.detail


def test_the_report_says_why_the_npus_were_not_read(tmp_path, monkeypatch):
    probe = real_probe(tmp_path, fake_npu_smi(tmp_path / "bin", stderr=DCMI, code=255), monkeypatch)
    report = doctor.diagnose(probe, STACK)
    text = doctor_report.render(report, probe, STACK, layer_requested=False)
    assert f"_Not read: NPU count and health: `npu-smi info` exited 255: {DCMI}._" in text


def test_a_bad_probe_timeout_setting_is_named(monkeypatch):
    monkeypatch.setenv(detect.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=rf"{detect.TIMEOUT_ENV}='soon': expected a finite number"):
        detect.command_timeout()


def run_doctor_cli(bin_dir: Path, tree: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("VERL_NPU_EXPECT_NPUS", None)
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "doctor", "--json", "--no-layer", "--site-packages", str(tree), *args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return done, json.loads(done.stdout)


def findings_of(report: dict) -> dict[str, dict]:
    return {f["check"]: f for f in report["findings"] if f["check"].startswith("platform")}


def test_the_doctor_cli_reads_a_real_a3_node_as_a3_with_16_npus(tmp_path):
    """The acceptance of issue 27: fed a real A3 capture through an npu-smi on PATH, `verl-npu doctor
    --expect-npus 16` says a3 and 16 NPUs on 8 cards (it said "unknown" and "npu-smi lists 8", and failed)."""
    bin_dir = install_npu_smi(tmp_path / "bin", A3_CAPTURE)
    _, report = run_doctor_cli(bin_dir, make_tree(tmp_path / "sp", {}), "--expect-npus", "16")
    plat = report["platform"]
    assert (plat["kind"], plat["target"], plat["devices"], plat["cards"]) == ("ascend", "a3", 16, 8)
    assert report["target"] == "a3"
    checks = findings_of(report)
    assert checks["platform"]["status"] == OK, checks
    expected = checks["platform.expected-npus"]
    assert (expected["status"], expected["detail"]) == (OK, "16 NPUs on 8 cards (two dies each), 16 expected")


def test_the_doctor_cli_takes_the_target_its_fix_names(tmp_path):
    """An unrecognised chip: doctor's fix names `verl-npu doctor --target`, and that option exists."""
    bin_dir = install_npu_smi(tmp_path / "bin", UNKNOWN_CAPTURE)
    tree = make_tree(tmp_path / "sp", {})
    done, report = run_doctor_cli(bin_dir, tree)
    assert done.returncode == 1
    fix = findings_of(report)["platform"]["fix"]
    assert "`verl-npu doctor --target a2`" in fix
    done, report = run_doctor_cli(bin_dir, tree, "--target", "a3")
    assert report["target"] == "a3"
    platform = findings_of(report)["platform"]
    assert platform["status"] == WARN and "checked as target a3 because --target says so" in platform["detail"]
    refused = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "doctor", "--target", "dev"], capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "invalid choice: 'dev'" in refused.stderr


def test_the_doctor_cli_fails_on_a_failing_npu_smi(tmp_path):
    """`verl-npu doctor` used to say "CPU only (no npu-smi)", 0 failed, exit 0 here."""
    bin_dir = fake_npu_smi(tmp_path / "bin", stderr=DCMI, code=255)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    tree = make_tree(tmp_path / "sp", {})
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "doctor", "--json", "--no-layer", "--site-packages", str(tree)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    platform = [f for f in report["findings"] if f["check"] == "platform"]
    assert platform[0]["status"] == FAIL and "exited 255" in platform[0]["detail"] and DCMI in platform[0]["detail"]
    assert "CPU only" not in report["platform"]["detail"]


# --- install.sh ---------------------------------------------------------------------------------------


def run_install(env: dict[str, str], prefix: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "install.sh"), "--dry-run", "--prefix", str(prefix)],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, **env}, timeout=300,
                          check=False)  # fmt: skip


def test_install_sh_stops_on_a_hanging_npu_smi_and_says_so(tmp_path):
    """npu-smi's own limit (the Python side) ends it and its child; the message names the timeout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hanging_script(bin_dir / "npu-smi", tmp_path / "pid")
    started = time.monotonic()
    done = run_install({"PATH": f"{bin_dir}:{os.environ['PATH']}", detect.TIMEOUT_ENV: "1"}, tmp_path / "p")
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert "`npu-smi info` did not answer within 1 s" in done.stderr, done.stderr
    assert 'ERROR in step "detect target"' in done.stderr and not (tmp_path / "p").exists()
    assert gone_soon(grandchild(tmp_path / "pid"))


def test_install_sh_bounds_the_whole_detection_with_timeout(tmp_path):
    """The shell's own bound, for a detection that does not return at all: `timeout` stops it and says why."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hanging_script(bin_dir / "npu-smi", tmp_path / "pid")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", detect.TIMEOUT_ENV: "600", "VERL_NPU_DETECT_TIMEOUT_S": "2"}
    started = time.monotonic()
    done = run_install(env, tmp_path / "p")
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert "the target detection (npu-smi info) did not finish within 2 s and was stopped" in done.stderr, done.stderr
    assert gone_soon(grandchild(tmp_path / "pid")), "timeout's SIGTERM must still end npu-smi's process group"


def test_install_sh_refuses_a_malformed_detect_timeout(tmp_path):
    done = run_install({"VERL_NPU_DETECT_TIMEOUT_S": "1; rm -rf /"}, tmp_path / "p")
    assert done.returncode != 0 and "VERL_NPU_DETECT_TIMEOUT_S='1; rm -rf /' is not a whole number" in done.stderr


def test_detect_target_names_a_failing_npu_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_npu_smi(tmp_path / 'bin', stderr=DCMI, code=255)}:{os.environ['PATH']}")
    with pytest.raises(detect.UnknownChipError, match=rf"`npu-smi info` exited 255: {DCMI}"):
        detect.detect_target()


def test_detect_target_refuses_output_without_an_npu_table(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_npu_smi(tmp_path / 'bin', stdout=b'910B but no table')}:{os.environ['PATH']}")
    with pytest.raises(detect.UnknownChipError, match="printed no NPU table"):
        detect.detect_target()
    monkeypatch.setenv("PATH", f"{fake_npu_smi(tmp_path / 'bin2', stdout=NPU_SMI_A2.encode())}:{os.environ['PATH']}")
    assert detect.detect_target() == "a2"


# --- ci/nightly/check_npus.sh: the first step of every Ascend job --------------------------------------


def run_check_npus(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(tmp_path), "ASCEND_ROOT": str(tmp_path / "no-ascend")}
    return subprocess.run(["bash", str(REPO / "ci/nightly/check_npus.sh")], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)  # fmt: skip


def test_check_npus_names_the_npu_smi_it_used_and_keeps_its_output_whole(tmp_path):
    bin_dir = install_npu_smi(tmp_path / "bin", A3_CAPTURE)
    done = run_check_npus(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert f"check_npus.sh: using npu-smi at {bin_dir}/npu-smi\n" in done.stderr
    assert done.stdout == npu_smi_capture(A3_CAPTURE)  # run_job.sh keeps stdout as npu-smi.txt


def test_check_npus_names_where_a_linked_npu_smi_really_is(tmp_path):
    real = install_npu_smi(tmp_path / "driver-tools", A3_CAPTURE) / "npu-smi"
    (tmp_path / "sbin").mkdir()
    (tmp_path / "sbin" / "npu-smi").symlink_to(real)
    done = run_check_npus(tmp_path, f"{tmp_path / 'sbin'}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert f"using npu-smi at {tmp_path / 'sbin' / 'npu-smi'} (-> {real})" in done.stderr


def test_check_npus_says_it_found_none_or_which_one_failed(tmp_path):
    (tmp_path / "empty").mkdir()
    done = run_check_npus(tmp_path, f"{tmp_path / 'empty'}:/usr/bin:/bin")
    assert done.returncode == 1
    assert "check_npus.sh: found no npu-smi: npu-smi is not on PATH" in done.stderr and "pod template" in done.stderr
    bin_dir = install_npu_smi(tmp_path / "bin", None, exit_code=3, stderr="dcmi module initialize failed. ret is -8005")
    done = run_check_npus(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert done.returncode == 1
    assert f'"npu-smi info" failed ({bin_dir}/npu-smi; its output is above)' in done.stderr
    assert "ret is -8005" in done.stderr
