"""Layer rules: the runtime layer as a trainer's fresh ``import verl`` and a Ray worker load it."""

from __future__ import annotations

import importlib.util
import json
import sys

from verl_npu import processes
from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.doctor.rules.env import LAYER_MODULE
from verl_npu.stack import NPU_TARGETS

LAYER_TIMEOUT_S = 600.0


def probe_layer(probe: Probe, target: str, *, ray: bool = True) -> tuple[dict | None, list[Finding]]:
    """Start Python the way a trainer does (``import verl``) and, with Ray, a worker from it.

    Returns what ``verl_npu.layer_probe`` saw, or None and the failure.
    """
    if importlib.util.find_spec("verl") is None:
        return None, [Finding("layer.process", FAIL, "verl is not installed", f"bash install.sh --target {target}")]
    want_ray = ray and importlib.util.find_spec("ray") is not None
    argv = [sys.executable, "-m", "verl_npu.layer_probe", *(["--ray"] if want_ray else [])]
    fix = "run: python -m verl_npu.layer_probe"
    try:
        done = processes.run(argv, env=probe.env, timeout=LAYER_TIMEOUT_S)
    except OSError as exc:
        return None, [Finding("layer.process", FAIL, f"could not start {sys.executable}: {exc}", fix)]
    if done.timed_out:  # its process group (Ray's workers included) has been ended
        return None, [Finding("layer.process", FAIL, f"probing the layer timed out after {LAYER_TIMEOUT_S:g} s", fix)]
    if done.returncode != 0:
        last = (str(done.stderr).strip().splitlines() or ["(no output)"])[-1]
        return None, [Finding("layer.process", FAIL, f"`import verl` failed: {last}", fix)]
    try:
        report = json.loads(str(done.stdout).strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None, [Finding("layer.process", FAIL, "the layer probe printed no JSON report", fix)]
    return report, []


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
