"""``verl-npu doctor`` end to end: diagnose over a whole node, and the command line.

The rules have one test module each (test_doctor_<area>.py); their environments are built by
tests_npu/support/doctor_env.py."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import doctor_env
from support.doctor_env import (
    DEV_MODULES,
    LAYER,
    NPU_MODULES,
    NPU_SMI_A3,
    STACK,
    UNLIMITED,
    a3_versions,
    dev_versions,
    install_patched_packages,
    make_cann,
    make_probe,
    make_tree,
    only,
    synthetic_contracts,
    write_build_manifest,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, GIB, OK, WARN, Probe
from verl_npu.doctor.rules import layer
from verl_npu.stack import build_manifest

shm_size = doctor_env.shm_size  # the fixture, under its own name


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


def diagnose_node(probe: Probe) -> doctor.Report:
    return doctor.diagnose(probe, STACK, contracts=synthetic_contracts(Path(probe.sys_path[0])))


def test_diagnose_warns_an_a3_node_without_verls_glm52_rollout_fixes(tmp_path: Path, shm_size) -> None:
    probe = _a3_node(tmp_path, shm_size)
    probe.env = {k: v for k, v in probe.env.items() if k != "VERL_VLLM_ASCEND_GLM52_PATCH"}
    report = diagnose_node(probe)
    assert not report.failed
    assert only(report.findings, "env.glm52-rollout-patch").status == WARN


def test_a_real_a3_node_whose_job_expects_16_npus_passes(tmp_path: Path, shm_size) -> None:
    """npu-smi as a real A3 node prints it (NPU_SMI_A3, vllm-project/vllm-ascend#4989) and the nightly jobs'
    VERL_NPU_EXPECT_NPUS=16: doctor used to read `unknown` and "npu-smi lists 8" and fail every A3 job."""
    probe = _a3_node(tmp_path, shm_size)
    probe.env = {**probe.env, doctor.EXPECT_NPUS_ENV: "16"}
    report = diagnose_node(probe)
    assert (report.platform.target, report.platform.devices, report.platform.cards) == ("a3", 16, 8)
    assert only(report.findings, "platform.expected-npus").status == OK
    assert not report.failed, [f for f in report.findings if f.status == FAIL]


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


# A busy 2-core CI machine runs a doctor several times slower than an idle one (60 s was not enough there); the
# limits still end a hang. The whole doctor with its layer probe gets its probe's own limit on top.
CLI_TIMEOUT_S = 300
LAYER_TIMEOUT_S = 300


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
        timeout=CLI_TIMEOUT_S,
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
    env = _cli_env(**{layer.LAYER_TIMEOUT_VARIABLE: str(LAYER_TIMEOUT_S)})  # doctor reports a slow probe itself
    limit = LAYER_TIMEOUT_S + CLI_TIMEOUT_S
    done = subprocess.run([*_verl_npu(), "doctor"], capture_output=True, text=True, env=env, timeout=limit, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target dev" in done.stdout
    assert "0 failed" in done.stdout
