"""``verl-npu doctor --report`` and the expected-NPU rule: complete on a dev box, an image without NPUs and a node,
secrets redacted, and a job that expects NPUs fails instead of passing as "CPU only"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.doctor_env import NPU_SMI_A3, STACK, make_probe, make_tree, npu_smi_table, only

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK
from verl_npu.doctor import report as doctor_report

SECRETS = {
    "VERL_HF_TOKEN": "hf_abcdefghijklmnop",
    "RAY_REDIS_PASSWORD": "s3cr3t-pw",
    "ASCEND_API_KEY": "k-123456789",
    "VERL_PRIVATE_THING": "private-value",
}


def node_root(tmp_path: Path) -> tuple[Path, Path]:
    """An Ascend install root with driver and firmware versions, and a CANN toolkit home."""
    root = tmp_path / "Ascend"
    (root / "driver").mkdir(parents=True)
    (root / "driver" / "version.info").write_text("Version=25.3.rc1\nascendhal_version=7.35.23\n")
    (root / "firmware").mkdir()
    (root / "firmware" / "version.info").write_text("Version=7.7.0.6.236\n")
    home = root / "ascend-toolkit" / "latest"
    home.mkdir(parents=True)
    (home / "version.cfg").write_text("version=9.1.0\n")
    return root, home


def render(probe, layer_report=None) -> str:
    report = doctor.diagnose(probe, STACK)
    if layer_report is not None:
        report = doctor.Report(report.platform, report.target, report.findings, layer_report)
    return doctor_report.render(report, probe, STACK, layer_requested=layer_report is not None, now="T")


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("HCCL_SOCKET_IFNAME", "eth0", "eth0"),
        ("VERL_HF_TOKEN", "hf_x", doctor_report.REDACTED),
        ("RAY_REDIS_PASSWORD", "pw", doctor_report.REDACTED),
        ("ASCEND_ACCESS_KEY_ID", "AK", doctor_report.REDACTED),
        ("VERL_NPU_REGISTRY_AUTH", "abc", doctor_report.REDACTED),
        ("RAY_ADDRESS", "http://admin:hunter2@head:8265", f"http://{doctor_report.REDACTED}@head:8265"),
        ("VERL_NPU_ENV_FILE", "/work/glm5_2.env", "/work/glm5_2.env"),
    ],
)
def test_secrets_are_redacted_by_name_and_url_credentials_dropped(name, value, shown):
    assert doctor_report.redact(name, value) == shown


def test_a_node_report_holds_every_section_and_no_secret(tmp_path):
    root, home = node_root(tmp_path)
    smi = npu_smi_table("Ascend910_9392", 4).replace(
        "| 2     Ascend910_9392      | OK ", "| 2     Ascend910_9392      | Warning "
    )
    env = {"ASCEND_TOOLKIT_HOME": str(home), "HCCL_SOCKET_IFNAME": "enp189s0f0", "PATH": "/usr/bin", **SECRETS}
    probe = make_probe([make_tree(tmp_path / "sp", {"torch": "2.10.0"})], npu=smi, env=env, ascend_root=root)
    layer = {
        "process": {"active": True, "platform": "ascend", "external_modules": doctor.LAYER_MODULE,
                    "patches": {"fused-rmsnorm": "applied", "dsa-index-share-forward": "pending"}},
        "ray_worker": {"active": True, "platform": "ascend", "forwarded": doctor.LAYER_MODULE,
                       "forwarded_variables": ["HCCL_BUFFSIZE", "VERL_USE_EXTERNAL_MODULES"],
                       "patches": {"fused-rmsnorm": "applied", "dsa-index-share-forward": "applied"}},
    }  # fmt: skip
    text = render(probe, layer)

    for value in SECRETS.values():
        assert value not in text
    for name in SECRETS:
        assert f"| {name} | {doctor_report.REDACTED} |" in text
    assert "| HCCL_SOCKET_IFNAME | enp189s0f0 |" in text
    assert "PATH" not in text.split("## Environment")[1].split("## Findings")[0]  # only the four prefixes
    for section in ("## Versions", "## CANN, driver and firmware", "## NPUs", "## torch, torch_npu and triton",
                    "## Runtime patches and the layer in a Ray worker", "## Findings", "## Not read"):  # fmt: skip
        assert section in text
    assert "| CANN toolkit | 9.1.0 |" in text
    assert "| NPU driver | 25.3.rc1 |" in text and "| NPU firmware | 7.7.0.6.236 |" in text
    assert "| npu-smi | 25.3.rc1 |" in text
    assert "4 NPU(s) listed by `npu-smi info`; 1 not OK." in text
    assert "| 2 | Ascend910_9392 | Warning |" in text
    assert "| dsa-index-share-forward | pending | applied |" in text
    assert "forwards HCCL_BUFFSIZE, VERL_USE_EXTERNAL_MODULES" in text
    assert "| torch-npu | not installed |" in text
    # the findings are doctor's own, all of them
    report = doctor.diagnose(probe, STACK)
    assert text.count("\n| ") - text.count("\n| check |") >= len(report.findings)
    assert "| version.torch-npu | fail |" in text
    assert "- build manifest: none found" in text  # the one thing this node lacks


def test_a_dev_box_report_says_what_it_could_not_read(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={})
    text = render(probe)
    unread = text.split("## Not read")[1]
    for missing in (
        "CANN version: ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH not set",
        "NPU driver version:",
        "NPU firmware version:",
        "NPU count and health: npu-smi is not on PATH",
        "runtime patches (`verl-npu patches` in a fresh `import verl` process): doctor ran with --no-layer",
        "build manifest: none found",
    ):
        assert missing in unread
    assert "Everything was read." not in text
    assert "None set." in text.split("## Environment")[1]


def test_an_npu_smi_that_fails_is_reported_as_failing_not_absent(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})])
    probe.which = lambda name: "/usr/local/sbin/npu-smi"
    text = render(probe)
    assert "NPU count and health: `/usr/local/sbin/npu-smi info` failed, timed out or printed nothing" in text


def test_table_cells_cannot_break_the_markdown(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={"VERL_NPU_NOTE": "a|b\nc"})
    assert "| VERL_NPU_NOTE | a\\|b<br>c |" in render(probe)


# --- a job that expects NPUs -------------------------------------------------------------------------


def expected(probe) -> doctor.Finding:
    return only(doctor.diagnose(probe, STACK).findings, "platform.expected-npus")


def test_without_the_expectation_a_cpu_node_is_fine(tmp_path):
    findings = doctor.diagnose(make_probe([make_tree(tmp_path / "sp", {})]), STACK).findings
    assert not [f for f in findings if f.check == "platform.expected-npus"]


def test_a_job_expecting_npus_fails_where_npu_smi_is_missing(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={doctor.EXPECT_NPUS_ENV: "16"})
    probe.which = lambda name: None
    finding = expected(probe)
    assert finding.status == FAIL
    assert "expects 16 NPUs" in finding.detail and "npu-smi is not on PATH" in finding.detail
    assert "/usr/local/Ascend/driver" in finding.fix and "pod template" in finding.fix
    assert doctor.diagnose(probe, STACK).failed


def test_a_job_expecting_npus_fails_where_npu_smi_fails(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={doctor.EXPECT_NPUS_ENV: "8"})
    probe.which = lambda name: "/usr/local/sbin/npu-smi"
    finding = expected(probe)
    assert finding.status == FAIL and "/usr/local/sbin/npu-smi is there but `npu-smi info` failed" in finding.detail


@pytest.mark.parametrize(
    ("smi", "want", "status"), [(NPU_SMI_A3, "16", OK), (npu_smi_table("Ascend910_9392", 8), "16", FAIL)]
)
def test_a_job_expecting_npus_counts_them(tmp_path, smi, want, status):
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=smi, env={doctor.EXPECT_NPUS_ENV: want})
    finding = expected(probe)
    assert finding.status == status
    if status == FAIL:
        assert "expects 16 NPUs" in finding.detail and "lists 8" in finding.detail


@pytest.mark.parametrize("value", ["0", "-4", "sixteen", "1.5"])
def test_a_bad_expectation_is_named(tmp_path, value):
    finding = expected(make_probe([make_tree(tmp_path / "sp", {})], env={doctor.EXPECT_NPUS_ENV: value}))
    assert finding.status == FAIL and f"{doctor.EXPECT_NPUS_ENV}={value!r}" in finding.detail


# --- the CLI ----------------------------------------------------------------------------------------


def verl_npu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_doctor_report_on_this_machine_writes_a_complete_report(tmp_path):
    out = tmp_path / "report.md"
    done = verl_npu("doctor", "--no-layer", "--report", str(out))
    assert done.returncode in (0, 1), done.stderr
    text = out.read_text()
    assert text.startswith("# verl-npu doctor report\n")
    for section in ("## Versions", "## NPUs", "## Environment", "## Findings", "## Not read"):
        assert section in text
    assert "| version.verl |" in text  # every finding of the run is in it
    assert not list(tmp_path.glob(".*.tmp"))


def test_doctor_report_into_a_missing_directory_is_refused_before_any_work(tmp_path):
    done = verl_npu("doctor", "--no-layer", "--report", str(tmp_path / "missing" / "report.md"))
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "missing").exists()


def test_doctor_expect_npus_fails_on_this_cpu_machine(tmp_path):
    done = verl_npu("doctor", "--no-layer", "--json", "--expect-npus", "16")
    assert done.returncode == 1
    assert '"check": "platform.expected-npus"' in done.stdout
    bad = verl_npu("doctor", "--no-layer", "--expect-npus", "0")
    assert bad.returncode == 2 and "'0' is not a positive integer" in bad.stderr
