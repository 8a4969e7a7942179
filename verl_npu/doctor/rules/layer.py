"""Layer rules: the runtime layer as a trainer's fresh ``import verl`` and a Ray worker load it."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from verl_npu import inputs, layer_probe, processes
from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.doctor.rules.env import LAYER_MODULE
from verl_npu.stack import NPU_TARGETS

# The whole probe (a fresh `import verl`, then a local Ray node and one worker) gets this long; a loaded
# node needs more, a real hang still ends.
LAYER_TIMEOUT_VARIABLE = "VERL_NPU_DOCTOR_LAYER_TIMEOUT_S"
DEFAULT_LAYER_TIMEOUT_S = 600.0
MAX_LAYER_TIMEOUT_S = 86400.0
# The probe stops waiting for its Ray worker this long (at most a quarter of the limit) before doctor kills
# it, so it can still say what it was waiting for.
KILL_MARGIN_S = 30.0
# Ray waits 30 s for a new node's GCS to come up; a probe sharing a loaded node needs more. Doctor sets this
# for its probe only, and only where the variable is unset.
DOCTOR_RAY_START_WAIT_S = 120
RAY_START_WAIT_VARIABLE = layer_probe.RAY_START_WAIT_VARIABLE
_GCS_PORT_TIMEOUT = re.compile(r"timed out waiting for file .*gcs_server_port", re.I | re.S)
_RAYLET_TIMEOUT = re.compile(r"node timed out during startup", re.I)
_TIMED_OUT = re.compile(r"timed? ?out|TimeoutError", re.I)
RAY_LOGS = "/tmp/ray/session_latest/logs (gcs_server.err, raylet.err)"


def layer_timeout(env: Mapping[str, str]) -> float:
    """The layer probe's time limit, from ``VERL_NPU_DOCTOR_LAYER_TIMEOUT_S`` (InputError when it is not one)."""
    raw = env.get(LAYER_TIMEOUT_VARIABLE, "")
    if not raw.strip():
        return DEFAULT_LAYER_TIMEOUT_S
    return inputs.number(LAYER_TIMEOUT_VARIABLE, raw, above=0, maximum=MAX_LAYER_TIMEOUT_S)


def probe_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The probe's environment: the node's, with doctor's Ray start wait where none is set (InputError: a bad one)."""
    env = dict(env)
    raw = env.get(RAY_START_WAIT_VARIABLE)
    if raw is None or not raw.strip():
        env[RAY_START_WAIT_VARIABLE] = str(DOCTOR_RAY_START_WAIT_S)
    else:  # Ray parses it with int() inside ray.init and would fail there
        inputs.integer(RAY_START_WAIT_VARIABLE, raw, minimum=0, maximum=int(MAX_LAYER_TIMEOUT_S))
    return env


def _short(text: str | None, limit: int = 300) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_ray_failure(worker: Mapping[str, Any], timeout_s: float) -> tuple[str, str]:
    """(detail, fix) for a ``{"failed": ...}`` record of the probe's Ray part: the cause, named."""
    stage, error, elapsed = worker.get("failed"), _short(worker.get("error")), worker.get("elapsed_s")
    after = f" after {elapsed:g} s" if isinstance(elapsed, int | float) else ""
    no_ray = "or check the layer without Ray: verl-npu doctor --no-ray"
    if stage == "start":
        wait = str(worker.get("start_wait_s") or "").strip()
        waited = f"{RAY_START_WAIT_VARIABLE}={wait} s" if wait else f"Ray's default ({RAY_START_WAIT_VARIABLE} unset)"
        suggest = max(300, 2 * int(wait)) if re.fullmatch("[0-9]{1,9}", wait) else 300
        if _GCS_PORT_TIMEOUT.search(error):
            detail = (
                f"Ray start timed out{after}: the local node's GCS did not come up within {waited} "
                "(a loaded node needs longer); `import verl` itself worked"
            )
            fix = (
                f"raise Ray's start wait, e.g. {RAY_START_WAIT_VARIABLE}={suggest} verl-npu doctor (doctor's default "
                f"is {DOCTOR_RAY_START_WAIT_S} s), {no_ray}; Ray's logs: {RAY_LOGS}"
            )
        elif _RAYLET_TIMEOUT.search(error):
            detail = (
                f"Ray start timed out{after}: the raylet did not register with the GCS within Ray's own wait, which "
                "no Ray setting changes (30 s as of Ray 2.60); `import verl` itself worked"
            )
            fix = f"rerun when the node is less loaded (see `uptime`), {no_ray}; Ray's logs: {RAY_LOGS}"
        elif _TIMED_OUT.search(error):
            detail = f"Ray start timed out{after}: {error}; `import verl` itself worked"
            fix = f"rerun when the node is less loaded, or raise {RAY_START_WAIT_VARIABLE}; {no_ray}"
        else:
            detail = f"Ray could not start a local node{after}: {error}; `import verl` itself worked"
            fix = f"see Ray's logs: {RAY_LOGS}; {no_ray}"
    elif stage == "worker-timeout":
        wait_s = worker.get("wait_s")
        waited = f" (waited {wait_s:g} s for it)" if isinstance(wait_s, int | float) else ""
        detail = (
            f"Ray started, but its worker had not reported when the probe's {timeout_s:g} s ran out{waited}; the "
            "worker imports verl, which a loaded node is slow at"
        )
        fix = f"raise {LAYER_TIMEOUT_VARIABLE} (now {timeout_s:g} s), {no_ray}"
    elif stage == "killed":
        detail = (
            f"the Ray check did not finish within {timeout_s:g} s and was killed with its process group "
            "(`import verl` itself worked)"
        )
        fix = f"raise {LAYER_TIMEOUT_VARIABLE} on a loaded node; {RAY_LOGS} show where Ray stopped; {no_ray}"
    else:  # "worker", "setup", "crashed"
        detail = f"the Ray check failed{after}: {error or 'no error recorded'}; `import verl` itself worked"
        fix = f"python -m verl_npu.layer_probe --ray shows the whole error; {no_ray}"
    return detail, fix


def _parts(stdout: str) -> dict:
    """The probe's report, merged from the JSON objects it printed, one a line (other lines ignored)."""
    seen: dict = {}
    for line in stdout.splitlines():
        try:
            part = json.loads(line)
        except ValueError:
            continue
        if isinstance(part, dict):
            seen.update({k: v for k, v in part.items() if k in ("process", "ray_worker")})
    return seen


def probe_layer(probe: Probe, target: str, *, ray: bool = True) -> tuple[dict | None, list[Finding]]:
    """Start Python the way a trainer does (``import verl``) and, with Ray, a worker from it.

    Returns what ``verl_npu.layer_probe`` saw, or None and the failure. A failed Ray part is in the
    report (``ray_worker["failed"]``), not a failure of the process part.
    """
    if importlib.util.find_spec("verl") is None:
        return None, [Finding("layer.process", FAIL, "verl is not installed", f"bash install.sh --target {target}")]
    try:
        timeout_s = layer_timeout(probe.env)
        env = probe_environment(probe.env)
    except inputs.InputError as exc:
        fix = f"set it as the message says, or unset it ({LAYER_TIMEOUT_VARIABLE}: {DEFAULT_LAYER_TIMEOUT_S:g} s, "
        fix += f"{RAY_START_WAIT_VARIABLE}: {DOCTOR_RAY_START_WAIT_S} s for doctor's probe)"
        return None, [Finding("layer.settings", FAIL, str(exc), fix)]
    want_ray = ray and importlib.util.find_spec("ray") is not None
    probe_timeout = timeout_s - min(KILL_MARGIN_S, timeout_s / 4)
    argv = [sys.executable, "-m", "verl_npu.layer_probe", "--timeout", f"{probe_timeout:g}"]
    argv += ["--ray"] if want_ray else []
    fix = "run: python -m verl_npu.layer_probe"
    try:
        done = processes.run(argv, env=env, timeout=timeout_s)
    except OSError as exc:
        return None, [Finding("layer.process", FAIL, f"could not start {sys.executable}: {exc}", fix)]
    seen = _parts(str(done.stdout))
    if "process" not in seen:
        if done.timed_out:  # its process group has been ended
            detail = f"`import verl` did not finish within {timeout_s:g} s (the probe's process group was killed)"
            fix = f"raise {LAYER_TIMEOUT_VARIABLE} on a loaded node; {fix}"
            return None, [Finding("layer.process", FAIL, detail, fix)]
        if done.returncode != 0:
            last = (str(done.stderr).strip().splitlines() or ["(no output)"])[-1]
            return None, [Finding("layer.process", FAIL, f"`import verl` failed: {last}", fix)]
        return None, [Finding("layer.process", FAIL, "the layer probe printed no JSON report", fix)]
    if want_ray and "ray_worker" not in seen:  # the process part finished; the Ray part hung or crashed
        if done.timed_out:
            seen["ray_worker"] = {"failed": "killed", "elapsed_s": timeout_s}
        else:
            last = (str(done.stderr).strip().splitlines() or ["(no output)"])[-1]
            seen["ray_worker"] = {"failed": "crashed", "error": f"exit {done.returncode}: {last}"}
    seen["timeout_s"] = timeout_s
    return seen, []


def check_layer(probe: Probe, target: str, *, ray: bool = True, report: dict | None = None) -> list[Finding]:
    """The runtime layer in a fresh process and a Ray worker (``report``: an earlier :func:`probe_layer` result)."""
    if report is None:
        report, failed = probe_layer(probe, target, ray=ray)
        if report is None:
            return failed
    findings = []
    proc = report["process"]
    if proc["active"]:
        counts: dict[str, int] = {}
        for status in proc["patches"].values():
            counts[status] = counts.get(status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        findings.append(Finding("layer.process", OK, f"active after `import verl` on {proc['platform']} ({summary})"))
    else:
        status = FAIL if target in NPU_TARGETS else WARN
        findings.append(
            Finding(
                "layer.process",
                status,
                "`import verl` does not load verl_npu.megatron_adaptor",
                f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}",
            )
        )
    worker = report.get("ray_worker")
    if worker is None:
        findings.append(Finding("layer.ray-worker", OK, "not checked (Ray not installed or --no-ray)"))
    elif worker.get("failed"):  # Ray could not run the check: on an NPU node the trainer's Ray fails the same way
        detail, fix = describe_ray_failure(worker, report.get("timeout_s", DEFAULT_LAYER_TIMEOUT_S))
        findings.append(Finding("layer.ray-worker", FAIL if target in NPU_TARGETS else WARN, detail, fix))
    elif worker["active"] and worker["forwarded"]:
        findings.append(Finding("layer.ray-worker", OK, "active in a Ray worker; runtime env forwards the layer"))
    else:
        status = FAIL if target in NPU_TARGETS or proc["active"] else WARN
        detail = "a Ray worker " + ("loads" if worker["active"] else "does not load") + " the layer; the runtime env "
        detail += (
            "forwards it"
            if worker["forwarded"]
            else "does not forward VERL_USE_EXTERNAL_MODULES (workers on other nodes miss it)"
        )
        findings.append(Finding("layer.ray-worker", status, detail, f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}"))
    return findings
