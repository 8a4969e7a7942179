"""``verl-npu doctor --report`` and the expected-NPU rule: complete on a dev box, an image without NPUs and a node,
secrets redacted, and a job that expects NPUs fails instead of passing as "CPU only"."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.doctor_env import (
    A2_CAPTURE,
    A2_X16_CAPTURE,
    A3_CAPTURE,
    NPU_SMI_A3,
    STACK,
    make_probe,
    make_tree,
    npu_smi_capture,
    only,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, redaction
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


# (variable, value, the secret parts that must go, what a maintainer needs and must stay)
SHAPES = [
    # the three leaks of issue 27: a query token, an access_token parameter, a bearer header in Ray's JSON
    ("RAY_ADDRESS", "http://h:8265?token=q1w2e3r4", ["q1w2e3r4"], ["http://h:8265?token="]),
    ("VERL_CKPT_URL", "https://store.lan:9000/ckpt/step_100?access_token=ya29.A0xyz&region=cn",
     ["ya29.A0xyz"], ["https://store.lan:9000/ckpt/step_100?access_token=", "&region=cn"]),
    ("RAY_JOB_HEADERS", '{"Authorization": "Bearer tok-9f8e7d6c5b", "X-Trace": "on"}',
     ["tok-9f8e7d6c5b"], ['"Authorization": "Bearer <redacted>"', '"X-Trace": "on"']),
    # the others
    ("VERL_RAY_CLIENT", "ray://admin:hunter2@head:10001", ["admin", "hunter2"], ["ray://", "@head:10001"]),
    ("VERL_DB_URL", "postgres://u:pw@db:5432/runs?sslmode=require&password=zz9",
     ["u:pw", "zz9"], ["@db:5432/runs?sslmode=require&password="]),
    ("VERL_S3_URL", "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAEXAMPLE%2F1&X-Amz-Signature=deadbeef99&X-Amz-Expires=3600",
     ["AKIAEXAMPLE", "deadbeef99"], ["https://b.s3.amazonaws.com/k?", "X-Amz-Expires=3600"]),
    ("RAY_PROMETHEUS_HEADERS", '[["Authorization", "Basic dXNlcjpwYXNzd29yZA=="], ["X-Org", "42"]]',
     ["dXNlcjpwYXNzd29yZA"], ['["X-Org", "42"]']),
    ("VERL_CURL", "curl -H 'X-Api-Key: k3y-v4lu3' -H 'Authorization: Basic dXNlcjpwYXNzd29yZA==' http://h/x",
     ["k3y-v4lu3", "dXNlcjpwYXNzd29yZA"], ["X-Api-Key: ", "Authorization: Basic ", "http://h/x"]),
    ("VERL_TRAIN_ARGS", "--hf-token hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123 --lr 1e-5 --api_key=zzz111",
     ["hf_AbCdEf", "zzz111"], ["--lr 1e-5", "--hf-token ", "--api_key="]),
    ("VERL_PY_CONF", "{'client_secret': 's3cr3tv4l', 'model': 'glm5'}", ["s3cr3tv4l"], ["'model': 'glm5'"]),
    ("VERL_SSH", r"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
     ["b3BlbnNzaC1rZXktdjEAAAAA"], ["-----BEGIN OPENSSH PRIVATE KEY-----", "-----END OPENSSH PRIVATE KEY-----"]),
    ("VERL_PEM", "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7wXyZ\nqq+/==\n-----END RSA PRIVATE KEY-----",
     ["MIIEpAIBAAKCAQEA7wXyZ", "qq+/=="], ["-----BEGIN RSA PRIVATE KEY-----"]),
    ("VERL_NOTES", "gh ghp_0123456789abcdefghijABCDEFGHIJ012345 aws AKIAIOSFODNN7EXAMPLE "
     "sk-proj-abcdefghijklmnopqrstuv glpat-abcdefghij0123456789 xoxb-1234567890-abcdef",
     ["0123456789abcdefghijABCDEFGHIJ", "IOSFODNN7EXAMPLE", "abcdefghijklmnopqrstuv", "abcdefghij0123456789",
      "1234567890-abcdef"], ["gh ghp_", "aws AKIA", "sk-", "glpat-", "xoxb-"]),
    ("VERL_JWT", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlLXZhbHVl", ["eyJhbGciOiJIUzI1NiJ9"], []),
    # values that only look alike stay whole
    ("HCCL_SOCKET_IFNAME", "eth0", [], ["eth0"]),
    ("VERL_USE_EXTERNAL_MODULES", "verl_npu.megatron_adaptor", [], ["verl_npu.megatron_adaptor"]),
    ("VERL_ALLOC", "expandable_segments:True", [], ["expandable_segments:True"]),
    ("RAY_DASHBOARD_URL", "http://10.0.0.5:8265/#/jobs?limit=20", [], ["http://10.0.0.5:8265/#/jobs?limit=20"]),
    ("VERL_NOTE", "Token authentication is on; basic checking", [], ["Token authentication is on; basic checking"]),
    ("VERL_TOKENIZER_PATH", "/models/glm5", [], ["/models/glm5"]),  # a tokenizer is no token
    ("VERL_GEN_ARGS", "--max_tokens=4096 --tokenizer /models/glm5", [], ["--max_tokens=4096 --tokenizer /models/glm5"]),
]  # fmt: skip


SHAPE_IDS = [f"{i}-{v[0]}" for i, v in enumerate(SHAPES)]


@pytest.mark.parametrize(("name", "value", "secrets", "kept"), SHAPES, ids=SHAPE_IDS)
def test_secrets_are_redacted_by_their_shape_and_what_debugs_stays(name, value, secrets, kept):
    shown = doctor_report.redact(name, value)
    for secret in secrets:
        assert secret not in shown, shown
    for part in kept:
        assert part in shown, shown
    assert (doctor_report.REDACTED in shown) == bool(secrets), shown
    assert doctor_report.redact(name, shown) == shown  # idempotent: a redacted report can be redacted again


@pytest.mark.parametrize(
    "hostile",
    [
        '"token": "' + "\\x" * 25_000,  # an unterminated quoted value full of escapes: no exponential backtracking
        "eyJaaaaa." * 5_000,  # scheme- and token-like runs without their ends
        "-----BEGIN PRIVATE KEY-----" + "A" * 50_000,
        "http://" + "a:b" * 15_000,
        "token=a&" * 6_000 + "X-Api-Key: b\n" * 3_000,
    ],
    ids=["escapes", "dots", "pem", "userinfo", "pairs"],
)
def test_redaction_stays_fast_on_hostile_text(hostile):
    began = time.monotonic()
    once = redaction.redact_text(hostile)
    assert redaction.redact_text(once) == once
    assert time.monotonic() - began < 10


def test_a_report_redacts_by_shape_everything_it_prints_not_only_the_environment(tmp_path):
    """Besides the environment table, findings quote what tools printed (the layer probe's last stderr line, a
    failing command's stderr): the whole page goes through the shapes."""
    env = {name: value for name, value, _, _ in SHAPES}
    assert len(env) == len(SHAPES)
    env["PATH"] = "/usr/bin"
    probe = make_probe([make_tree(tmp_path / "sp", {})], env=env)
    report = doctor.diagnose(probe, STACK)
    leaked_by_a_tool = doctor.Finding(
        "layer.process", FAIL,
        "`import verl` failed: OSError: proxy https://bob:pr0xyp4ss@proxy.lan:3128 refused; "
        "headers {'Authorization': 'Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlLXZhbHVl'}; "
        "X-Api-Key: k3yv4l|cell",
    )  # fmt: skip
    report = doctor.Report(report.platform, report.target, [*report.findings, leaked_by_a_tool])
    text = doctor_report.render(report, probe, STACK, layer_requested=False, now="T")

    for _, _, secrets, _ in SHAPES:
        for secret in secrets:
            assert secret not in text
    for leaked in ("pr0xyp4ss", "bob:", "eyJhbGciOiJIUzI1NiJ9", "hf_AbCdEf", "k3yv4l"):
        assert leaked not in text
    findings = text.split("## Findings")[1].split("## Not read")[0].strip().splitlines()
    columns = {len(re.findall(r"(?<!\\)\|", row)) for row in findings}
    assert columns == {5}, "a redaction broke a Markdown table row"
    assert "| RAY_ADDRESS | http://h:8265?token=<redacted> |" in text
    assert "proxy https://<redacted>@proxy.lan:3128 refused" in text
    assert "{'Authorization': 'Bearer <redacted>'}" in text
    assert "| HCCL_SOCKET_IFNAME | eth0 |" in text


def test_a_node_report_holds_every_section_and_no_secret(tmp_path):
    root, home = node_root(tmp_path)
    env = {"ASCEND_TOOLKIT_HOME": str(home), "HCCL_SOCKET_IFNAME": "enp189s0f0", "PATH": "/usr/bin", **SECRETS}
    probe = make_probe([make_tree(tmp_path / "sp", {"torch": "2.10.0"})], npu=NPU_SMI_A3, env=env, ascend_root=root)
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
    assert "| npu-smi | 25.2.1 |" in text
    assert "16 NPUs on 8 cards (two dies each) listed by `npu-smi info`; 0 not OK." in text
    assert "| NPU | chip | Phy-ID | name | health | Bus-Id |" in text
    assert "| 7 | 1 | 15 | Ascend910 | OK | 0000:83:00.0 |" in text
    assert "- platform: Atlas A3 (Ascend910), 16 NPUs on 8 cards (two dies each), from npu-smi 25.2.1" in text
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
    ("capture", "status", "listed"),
    [
        # an A3 node: 8 cards of two dies are the 16 NPUs its jobs get (once "npu-smi lists 8": every job failed)
        (A3_CAPTURE, OK, "16 NPUs on 8 cards (two dies each), 16 expected"),
        (A2_X16_CAPTURE, OK, "16 NPUs, 16 expected"),
        (A2_CAPTURE, FAIL, "this job expects 16 NPUs (VERL_NPU_EXPECT_NPUS), npu-smi lists 8 NPUs"),
    ],
)
def test_a_job_expecting_16_npus_counts_them(tmp_path, capture, status, listed):
    smi = npu_smi_capture(capture)
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=smi, env={doctor.EXPECT_NPUS_ENV: "16"})
    finding = expected(probe)
    assert (finding.status, finding.detail) == (status, listed)


def test_the_report_and_the_expected_npus_check_say_the_same_count(tmp_path):
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3, env={doctor.EXPECT_NPUS_ENV: "16"})
    report = doctor.diagnose(probe, STACK)
    text = doctor_report.render(report, probe, STACK, layer_requested=False)
    check = only(report.findings, "platform.expected-npus")
    assert check.status == OK and check.detail.startswith("16 NPUs on 8 cards (two dies each)")
    assert text.count("16 NPUs on 8 cards (two dies each)") >= 3  # platform line, NPUs section, the finding
    assert "NPU(s)" not in text and "8 NPUs" not in text.replace("8 NPUs on", "")


def test_a_chip_that_is_not_ok_is_counted(tmp_path):
    """No public capture shows a chip in a bad state; this one is a real A3 capture with one die's health cell
    replaced by `Alarm`, one of the health values npu-smi prints."""
    row = "| 3     Ascend910           | OK            | -           34"
    smi = NPU_SMI_A3.replace(row, row.replace("OK   ", "Alarm"))
    assert smi != NPU_SMI_A3
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=smi)
    text = doctor_report.render(doctor.diagnose(probe, STACK), probe, STACK, layer_requested=False)
    assert "16 NPUs on 8 cards (two dies each) listed by `npu-smi info`; 1 not OK." in text
    assert "| 3 | 1 | 7 | Ascend910 | Alarm | 0000:93:00.0 |" in text


@pytest.mark.parametrize("value", ["0", "-4", "sixteen", "1.5"])
def test_a_bad_expectation_is_named(tmp_path, value):
    finding = expected(make_probe([make_tree(tmp_path / "sp", {})], env={doctor.EXPECT_NPUS_ENV: value}))
    assert finding.status == FAIL and f"{doctor.EXPECT_NPUS_ENV}={value!r}" in finding.detail


# --- the CLI ----------------------------------------------------------------------------------------


def verl_npu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", *args],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip


def test_doctor_report_on_this_machine_writes_a_complete_report(tmp_path):
    out = tmp_path / "report.md"
    leaks = {name: value for name, value, _, _ in SHAPES[:3]}  # the three forms issue 27 saw leak
    done = verl_npu("doctor", "--no-layer", "--report", str(out), env={**os.environ, **leaks})
    assert done.returncode in (0, 1), done.stderr
    text = out.read_text()
    assert text.startswith("# verl-npu doctor report\n")
    for section in ("## Versions", "## NPUs", "## Environment", "## Findings", "## Not read"):
        assert section in text
    for secret in ("q1w2e3r4", "ya29.A0xyz", "tok-9f8e7d6c5b"):
        assert secret not in text
    assert "| RAY_ADDRESS | http://h:8265?token=<redacted> |" in text
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
    assert bad.returncode == 2 and "--expect-npus=0: expected an integer from 1 to 1048576" in bad.stderr
