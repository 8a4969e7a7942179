"""Doctor's layer probe (``verl_npu.layer_probe`` in a fresh process, then a Ray worker): a Ray that cannot start
is named as such, with the wait that ran out and how to raise it, never as an ``import verl`` failure; the probe's
time limit is configurable and still ends a probe that takes too long."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
from support.doctor_env import STACK, make_probe, make_tree, only

from verl_npu import doctor, layer_probe, processes
from verl_npu.doctor import FAIL, WARN
from verl_npu.doctor import report as doctor_report
from verl_npu.doctor.rules import layer


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # an import hook that refuses the name (the accel tier's collection check)
        return False


needs_verl = pytest.mark.skipif(not installed("verl"), reason="verl is not installed")
needs_ray = pytest.mark.skipif(not installed("ray"), reason="Ray is not installed")


def this_node(**env: str) -> doctor.Probe:
    """This interpreter and node (the probe runs it), with ``env`` on top of this process's environment."""
    probe = doctor.Probe.current()
    probe.env = {k: v for k, v in {**os.environ, **env}.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    return probe


@needs_verl
@needs_ray
def test_a_ray_start_that_times_out_is_named_with_its_wait_not_called_an_import_failure():
    # Ray's real start path, made to time out at once: its GCS gets 0 s to publish its port.
    probe = this_node(**{layer.RAY_START_WAIT_VARIABLE: "0"})
    seen, failed = layer.probe_layer(probe, "dev")
    assert failed == [] and seen is not None, failed
    assert seen["process"]["active"] is False  # the fresh `import verl` part ran and reported
    assert seen["ray_worker"]["failed"] == "start" and seen["ray_worker"]["start_wait_s"] == "0"

    findings = layer.check_layer(probe, "dev", report=seen)
    assert not [f for f in findings if "import verl` failed" in f.detail]
    worker = only(findings, "layer.ray-worker")
    assert worker.status == WARN  # a dev box: Ray could not run the check
    assert worker.detail.startswith("Ray start timed out after ")
    assert f"{layer.RAY_START_WAIT_VARIABLE}=0 s" in worker.detail and "`import verl` itself worked" in worker.detail
    assert f"{layer.RAY_START_WAIT_VARIABLE}=300 verl-npu doctor" in worker.fix and "--no-ray" in worker.fix
    # on an NPU node the trainer's Ray would fail the same way: a failure there
    assert only(layer.check_layer(probe, "a3", report=seen), "layer.ray-worker").status == FAIL

    report = doctor.Report(doctor.detect_platform(probe), "dev", findings, seen)
    text = doctor_report.render(report, probe, STACK, now="T")
    assert "- the layer in a Ray worker: Ray start timed out after " in text.split("## Not read")[1]
    assert "Fresh process: layer NOT active" in text


@pytest.mark.parametrize(
    ("error", "said"),
    [
        ("RuntimeError: Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ab12",
         "the local node's GCS did not come up within RAY_gcs_server_port_wait_time_s=120 s"),
        ("Exception: The current node timed out during startup. ...",
         "the raylet did not register with the GCS within Ray's own wait, which no Ray setting changes"),
        ("TimeoutError: something else timed out", "Ray start timed out after 31.5 s: TimeoutError: something"),
        ("ValueError: bad resources", "Ray could not start a local node after 31.5 s: ValueError: bad resources"),
    ],
)  # fmt: skip
def test_each_way_ray_start_fails_is_named(error, said):
    record = {"failed": "start", "error": error, "elapsed_s": 31.5, "start_wait_s": "120"}
    detail, fix = layer.describe_ray_failure(record, 600.0)
    assert said in detail and "`import verl` itself worked" in detail
    assert "verl-npu doctor --no-ray" in fix


def test_a_worker_that_does_not_report_names_the_time_limit_and_its_variable():
    detail, fix = layer.describe_ray_failure({"failed": "worker-timeout", "elapsed_s": 540.0, "wait_s": 540.0}, 600)
    assert detail.startswith("Ray started, but its worker had not reported when the probe's 600 s ran out")
    assert "(waited 540 s for it)" in detail
    assert f"raise {layer.LAYER_TIMEOUT_VARIABLE} (now 600 s)" in fix


def test_doctor_gives_its_probe_a_generous_ray_start_wait_and_keeps_the_users():
    assert layer.probe_environment({})[layer.RAY_START_WAIT_VARIABLE] == str(layer.DOCTOR_RAY_START_WAIT_S)
    assert layer.DOCTOR_RAY_START_WAIT_S > 30  # Ray's own default, too short on a loaded node
    assert layer.probe_environment({layer.RAY_START_WAIT_VARIABLE: "45"})[layer.RAY_START_WAIT_VARIABLE] == "45"
    assert layer.layer_timeout({}) == layer.DEFAULT_LAYER_TIMEOUT_S
    assert layer.layer_timeout({layer.LAYER_TIMEOUT_VARIABLE: "1200"}) == 1200.0


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        (layer.LAYER_TIMEOUT_VARIABLE, "ten", "expected a finite number > 0 and <= 86400"),
        (layer.LAYER_TIMEOUT_VARIABLE, "0", "expected a finite number > 0 and <= 86400"),
        (layer.LAYER_TIMEOUT_VARIABLE, "nan", "expected a finite number > 0 and <= 86400"),
        (layer.LAYER_TIMEOUT_VARIABLE, "1e9", "expected a finite number > 0 and <= 86400"),
        (layer.RAY_START_WAIT_VARIABLE, "1.5", "expected an integer from 0 to 86400"),
        (layer.RAY_START_WAIT_VARIABLE, "-3", "expected an integer from 0 to 86400"),
    ],
)
@needs_verl
def test_a_bad_time_limit_is_named_and_nothing_is_started(tmp_path, monkeypatch, variable, value, allowed):
    started = []
    monkeypatch.setattr(processes, "run", lambda *a, **k: started.append(a))
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={variable: value})
    seen, failed = layer.probe_layer(probe, "dev")
    assert seen is None and started == []
    finding = only(failed, "layer.settings")
    assert finding.status == FAIL and finding.detail.startswith(f"{variable}=") and finding.detail.endswith(allowed)
    assert value in finding.detail
    assert layer.LAYER_TIMEOUT_VARIABLE in finding.fix and layer.RAY_START_WAIT_VARIABLE in finding.fix


@needs_verl
def test_the_probes_time_limit_is_configurable_and_ends_a_probe_that_takes_longer():
    # A fresh `import verl` takes seconds (torch, Ray, transformers): half a second ends it, with its group.
    probe = this_node(**{layer.LAYER_TIMEOUT_VARIABLE: "0.5"})
    began = time.monotonic()
    seen, failed = layer.probe_layer(probe, "dev")
    took = time.monotonic() - began
    assert took < 0.5 + processes.GRACE_S + processes.REAP_S + 10, took
    if seen is None:  # the usual case: killed while importing verl
        finding = only(failed, "layer.process", FAIL)
        assert finding.detail.startswith("`import verl` did not finish within 0.5 s")
    else:  # a machine that imports verl within 0.4 s: the Ray part is what ran out
        finding = only(layer.check_layer(probe, "dev", report=seen), "layer.ray-worker")
        assert finding.status == WARN and "0.5 s" in finding.detail + finding.fix
    assert layer.LAYER_TIMEOUT_VARIABLE in finding.fix


@pytest.mark.parametrize(
    "args", [["--timeout"], ["--timeout", "x"], ["--timeout", "-3"], ["--timeout", "inf"], ["--timeout", "١٦"]]
)
def test_the_probe_refuses_a_bad_timeout_by_name_before_importing_verl(capsys, args):
    assert layer_probe.main(args) == 2
    given = args[1] if len(args) > 1 else "nothing"
    said = capsys.readouterr().err.strip()
    assert said == f"verl_npu.layer_probe: --timeout={given!r}: expected a finite number > 0 (seconds)"
