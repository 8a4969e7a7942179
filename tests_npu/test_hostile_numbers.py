"""Issue 29, class 4: numbers in other scripts.

Python's int() and float() read Arabic-Indic ('١٦'), full-width (U+FF10-FF19) and other Unicode digits, '1_6' and
non-ASCII spaces; str.isdigit() also passes superscripts ('²') that int() then refuses. bash, Kubernetes, Ray and
HCCL read ASCII only. Every numeric option and variable verl-npu reads goes through verl_npu/inputs.py, so
`doctor --expect-npus '١٦'` is refused as `k8s render --nnodes '١٦'` is, naming where the value came from.
tests_npu/fuzz/test_fuzz_numbers.py runs every such surface against generated digit strings.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from support.doctor_env import A2_CAPTURE, npu_smi_capture

from verl_npu import doctor, inputs
from verl_npu.checks import FAIL
from verl_npu.cli import main
from verl_npu.cluster import network, smoke
from verl_npu.doctor.rules.platform import EXPECT_NPUS_ENV, check_expected_npus
from verl_npu.stack import MANIFEST_PATH, StackError, detect, load_stack
from verl_npu.stack.detect import Platform

ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
# what int() or str.isdigit() took for a number and nothing downstream does
OTHER_SCRIPTS = ["١٦", "\uff11\uff16", "۱۶", "१६", "²", "1_6", "\u300016", "16\xa0"]
FULL_WIDTH_61010 = "61010".translate(str.maketrans("0123456789", "".join(map(chr, range(0xFF10, 0xFF1A)))))
CPU = Platform("cpu", "dev", "CPU only (no npu-smi, no nvidia-smi)")


def _probe(env: dict[str, str], expect_npus: int | None = None) -> doctor.Probe:
    return doctor.Probe(env=env, sys_path=[], which=lambda name: None, expect_npus=expect_npus)


# --- verl_npu.inputs: the one parser -------------------------------------------------------------


@pytest.mark.parametrize("value", OTHER_SCRIPTS)
def test_inputs_read_ascii_digits_only(value):
    with pytest.raises(inputs.InputError, match=re.escape(f"N={value!r}: expected an integer")):
        inputs.integer("N", value)
    with pytest.raises(inputs.InputError, match=re.escape(f"X={value!r}: expected a finite number")):
        inputs.number("X", value)


@pytest.mark.parametrize(("value", "parsed"), [("16", 16), (" 16\n", 16), ("+16", 16), ("\t-3 ", -3)])
def test_inputs_still_read_ascii_integers_with_ascii_spacing(value, parsed):
    assert inputs.integer("N", value) == parsed
    assert inputs.number("X", value) == float(parsed)


# --- verl-npu doctor --expect-npus / VERL_NPU_EXPECT_NPUS ----------------------------------------------------


@pytest.mark.parametrize("value", [*OTHER_SCRIPTS, "0x10", "1e1", "16.0", "0", "1048577"])
def test_doctor_expect_npus_is_exit_2_naming_the_option_before_any_probe(value, monkeypatch, capsys):
    def probed(cls):
        raise AssertionError("doctor probed the node before its options were checked")

    monkeypatch.setattr(doctor.Probe, "current", classmethod(probed))
    monkeypatch.delenv(EXPECT_NPUS_ENV, raising=False)
    assert main(["doctor", "--no-layer", "--expect-npus", value]) == 2
    err = capsys.readouterr().err
    shown = repr(value) if not re.fullmatch("[0-9]+", value) else value  # inputs shows a parsed integer as one
    assert f"verl-npu doctor: --expect-npus={shown}: expected an integer from 1 to 1048576" in err, err
    assert EXPECT_NPUS_ENV not in err  # the variable was not set: the message must not blame it


def test_a_bad_expect_npus_is_refused_before_a_bad_report_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctor.Probe, "current", classmethod(lambda cls: pytest.fail("probed")))
    assert main(["doctor", "--expect-npus", "١٦", "--report", str(tmp_path / "no" / "r.md")]) == 2
    assert "--expect-npus='١٦'" in capsys.readouterr().err
    assert main(["doctor", "--expect-npus", "16", "--report", str(tmp_path / "no" / "r.md")]) == 2
    assert f"--report {tmp_path / 'no' / 'r.md'}: directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err


def test_the_expected_npus_finding_names_the_option_that_gave_the_count():
    """The option used to be copied into the probe's VERL_NPU_EXPECT_NPUS, so every finding blamed the variable."""
    (finding,) = check_expected_npus(_probe({EXPECT_NPUS_ENV: "8"}, expect_npus=16), CPU)
    assert finding.status == FAIL
    assert finding.detail.startswith("this job expects 16 NPUs (--expect-npus), but npu-smi is not on PATH")
    (from_env,) = check_expected_npus(_probe({EXPECT_NPUS_ENV: "8"}), CPU)
    assert from_env.detail.startswith(f"this job expects 8 NPUs ({EXPECT_NPUS_ENV}), but npu-smi is not on PATH")


@pytest.mark.parametrize("value", OTHER_SCRIPTS)
def test_verl_npu_expect_npus_in_other_digits_fails_naming_the_variable(value):
    (finding,) = check_expected_npus(_probe({EXPECT_NPUS_ENV: value}), CPU)
    assert finding.status == FAIL
    assert finding.detail == f"{EXPECT_NPUS_ENV}={value!r}: expected an integer from 1 to 1048576"
    assert "ASCII digits" in finding.fix


def test_doctor_with_expect_npus_runs_and_fails_on_this_cpu_machine_naming_the_option(monkeypatch, capsys):
    monkeypatch.setenv(EXPECT_NPUS_ENV, "8")
    monkeypatch.setenv("PATH", "/nonexistent")  # no npu-smi, whatever this machine has
    assert main(["doctor", "--no-layer", "--json", "--expect-npus", "16"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    (expected,) = [f for f in findings if f["check"] == "platform.expected-npus"]
    assert expected["status"] == FAIL
    assert expected["detail"].startswith("this job expects 16 NPUs (--expect-npus), but npu-smi is not on PATH")


# --- python -m verl_npu.cluster.smoke ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--expect", "١٦"), ("--expect", "²"), ("--expect", "1_6"), ("--expect", "0"), ("--expect", "\uff11\uff16"),
        ("--wait-timeout", "nan"), ("--wait-timeout", "١٨٠٠"), ("--wait-timeout", "1_800"), ("--wait-timeout", "0"),
        ("--reduce-timeout", "inf"), ("--reduce-timeout", "-1"), ("--reduce-timeout", "\uff16\uff10\uff10"),
    ],
)  # fmt: skip
def test_smoke_numbers_are_exit_2_naming_the_option_before_ray(option, value, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # reaching `import ray` fails the test with ImportError instead
    argv = ["--expect", value] if option == "--expect" else ["--expect", "2", option, value]
    with pytest.raises(SystemExit) as stopped:
        smoke.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"error: {re.escape(option)}=('?){re.escape(value)}\1: expected", err), err


def test_smoke_json_into_a_missing_directory_is_exit_2_before_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SystemExit) as stopped:
        smoke.main(["--expect", "2", "--json", str(tmp_path / "no" / "ranks.json")])
    assert stopped.value.code == 2
    assert f"--json {tmp_path / 'no' / 'ranks.json'}: directory {tmp_path / 'no'} does not exist" in (
        capsys.readouterr().err
    )


def test_smoke_reads_ascii_numbers():
    args = smoke.parse_args(["--expect", "512", "--wait-timeout", "1.5e3", "--reduce-timeout", "600"])
    assert (args.expect, args.wait_timeout, args.reduce_timeout, args.resource) == (512, 1500.0, 600.0, "NPU")


# --- verl_npu.cluster.network: Ray and HCCL ports -----------------------------------------------------------


def test_ray_start_args_refuse_a_port_in_other_digits():
    """`ray start --port=٦٣٧٩` was printed for ray_start.sh: isdigit() passed it and Ray then failed to parse it."""
    with pytest.raises(network.NetworkError, match=re.escape("RAY_PORT='٦٣٧٩' is not a port number (1-65535)")):
        network.ray_start_args({"RAY_PORT": "٦٣٧٩"}, "head")
    with pytest.raises(network.NetworkError, match="RAY_MIN_WORKER_PORT='²' is not a port number"):
        network.ray_start_args({"RAY_MIN_WORKER_PORT": "²"}, "worker")
    assert network.ray_start_args({"RAY_PORT": " 6380 ", "RAY_MAX_WORKER_PORT": "20000"}, "head") == [
        "--port=6380", "--max-worker-port=20000",
    ]  # fmt: skip


def _network_findings(tmp_path, env: dict[str, str]):
    (tmp_path / "net").mkdir(exist_ok=True)
    (tmp_path / "dev").mkdir(exist_ok=True)
    return network.check_network(
        env, sys_class_net=tmp_path / "net", port_in_use=lambda port: False, node="node7",
        proc_sys=tmp_path / "proc_sys", dev=tmp_path / "dev", addresses=lambda: {},
    )  # fmt: skip


@pytest.mark.parametrize("name", network.RAY_PORT_VARIABLES)
def test_a_ray_port_variable_in_other_digits_fails_the_network_check_by_name(tmp_path, name):
    """It used to be read as the port (Arabic-Indic digits) or replaced by Ray's default without a word."""
    (failed,) = [f for f in _network_findings(tmp_path, {name: "٦٣٨٠"}) if f.check == "network.ray_ports"]
    assert (failed.status, failed.detail) == (FAIL, f"{name}='٦٣٨٠' on node7 is not a port number (1-65535)")
    assert [f for f in _network_findings(tmp_path, {name: "16380"}) if f.check == "network.ray_ports"] == []


@pytest.mark.parametrize(
    ("env", "detail"),
    [
        ({"HCCL_IF_BASE_PORT": "٦٠٠٠٠"}, "HCCL_IF_BASE_PORT='٦٠٠٠٠' on node7 is not a port in 1024-65520"),
        ({"HCCL_IF_BASE_PORT": "6_0000"}, "HCCL_IF_BASE_PORT='6_0000' on node7 is not a port in 1024-65520"),
        ({"HCCL_HOST_SOCKET_PORT_RANGE": "٦١٠٠٠-٦١٠١٠"}, "'٦١٠٠٠-٦١٠١٠' is not a port or a range lo-hi"),
        ({"HCCL_HOST_SOCKET_PORT_RANGE": f"61000-{FULL_WIDTH_61010}"}, f"'61000-{FULL_WIDTH_61010}' is not a port"),
    ],
)
def test_hccl_ports_in_other_digits_fail(tmp_path, env, detail):
    failed = [f for f in _network_findings(tmp_path, env) if f.check == "network.hccl_ports"]
    assert failed[0].status == FAIL and detail in failed[0].detail, failed


# --- npu-smi output ----------------------------------------------------------------------------------------


def test_npu_smi_rows_numbered_in_other_digits_are_not_counted_as_npus():
    """A real npu-smi prints ASCII; rows whose NPU and chip numbers are Arabic-Indic (which int() reads) were
    counted as 8 NPUs. Only the first cell of each row is rewritten: the bus ids stay as npu-smi printed them."""
    capture = npu_smi_capture(A2_CAPTURE)
    assert len(detect.read_npu_smi(capture).chips) == 8
    rewritten = "\n".join(
        "|".join([cells[0], cells[1].translate(ARABIC_INDIC), *cells[2:]]) if len(cells) > 2 else line
        for line in capture.splitlines()
        for cells in [line.split("|")]
    )
    assert rewritten != capture
    assert detect.read_npu_smi(rewritten).chips == ()
    platform = detect.detect_platform(lambda argv: rewritten if argv[0] == "npu-smi" else None)
    assert platform.problem is not None and "printed no NPU table verl-npu recognises" in platform.problem


# --- the stack manifest --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('version = "0.9.1"', 'version = "\u0660.\u0669.\u0661"'),  # Arabic-Indic digits: no version to pip
        ('version = "0.9.1"', 'version = "0.9.1\\n"'),  # a newline would split install.sh's plan line
        ('[python]\nversion = "3.12"', '[python]\nversion = "3.\u0661\u0662"'),
    ],
)
def test_a_manifest_version_in_other_digits_is_refused(tmp_path, old, new):
    text = MANIFEST_PATH.read_text()
    assert old in text
    path = tmp_path / "stack.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(StackError, match="version"):
        load_stack(path)


def test_a_registry_port_in_other_digits_is_refused():
    from verl_npu.k8s import render

    for registry in ("registry.local:\u0665\u0660\u0660\u0660/team", "registry.local:\uff15\uff10\uff10\uff10/team"):
        assert render._REGISTRY.match(registry) is None, registry
    assert render._REGISTRY.match("registry.local:5000/team")


def test_a_checksum_point_numbered_in_other_digits_is_refused():
    from verl_npu.parity.compare import ParityCompareError, depth

    assert depth("mb0/layers.3.self_attention") == (3, 0)
    with pytest.raises(ParityCompareError, match="checksum point"):
        depth("mb0/layers.٣.self_attention")
