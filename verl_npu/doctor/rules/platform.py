"""Platform rules: the node's chip (verl_npu.stack.detect) against the image, and the NPUs a job expects."""

from __future__ import annotations

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS, Stack, detect
from verl_npu.stack.detect import Platform

EXPECT_NPUS_ENV = "VERL_NPU_EXPECT_NPUS"
MOUNT_NPUS = (
    "give the container the NPUs (/dev/davinci*, /dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc), the host "
    "driver (/usr/local/Ascend/driver) and npu-smi (/usr/local/sbin/npu-smi): on Kubernetes through the "
    "huawei.com/ascend-* resource and hostPath mounts (for Kubernetes-mode runners, in the runner's pod template: "
    "docker `options:` are ignored there); with docker, --device and -v"
)

NPU_SMI_BROKEN = (
    "run `npu-smi info` on the node (as root, then in the container): a dcmi error or a hang means the NPU driver "
    "is not loaded or not mounted (check dmesg, /dev/davinci*, /usr/local/Ascend/driver and /usr/local/dcmi); "
    "report the output if it prints a table verl-npu does not read"
)


def detect_platform(probe: Probe) -> Platform:
    """The node as the probe's ``npu-smi`` / ``nvidia-smi`` show it (the one detector: verl_npu.stack.detect)."""
    return detect.detect_platform(probe.run)


def check_expected_npus(probe: Probe, plat: Platform) -> list[Finding]:
    """Inside a job that expects NPUs (``VERL_NPU_EXPECT_NPUS``), a node without them is a failure, not "CPU only".

    verl's vLLM rollout on NPU runs ``npu-smi`` with no fallback, so its absence fails the job later anyway.
    """
    raw = probe.env.get(EXPECT_NPUS_ENV, "").strip()
    if not raw:
        return []
    if not raw.isdigit() or int(raw) < 1:
        return [
            Finding(
                "platform.expected-npus", FAIL, f"{EXPECT_NPUS_ENV}={raw!r} is not a positive integer",
                f"set {EXPECT_NPUS_ENV} to the NPUs the job needs on this node (8 on A2, 16 on A3), or unset it",
            )
        ]  # fmt: skip
    expected = int(raw)
    if plat.kind != "ascend":
        where = probe.which("npu-smi")
        seen = (
            "npu-smi is not on PATH"
            if where is None
            else f"{where} is there but `npu-smi info` failed or printed no NPU table"
        )
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({EXPECT_NPUS_ENV}), but {seen}; the node looks like {plat.detail}",
                MOUNT_NPUS,
            )
        ]  # fmt: skip
    if plat.problem is not None:
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({EXPECT_NPUS_ENV}), but {plat.problem}", NPU_SMI_BROKEN,
            )
        ]  # fmt: skip
    if plat.devices is None or plat.devices < expected:
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({EXPECT_NPUS_ENV}), npu-smi lists {plat.devices or 'none'}",
                "request all of the node's NPUs for the job (huawei.com/ascend-* limit, runner label) and check "
                "`npu-smi info` for NPUs in a bad state",
            )
        ]  # fmt: skip
    return [Finding("platform.expected-npus", OK, f"{plat.devices} NPUs, {expected} expected")]


def check_platform(probe: Probe, stack: Stack, plat: Platform, target: str, built: dict | None) -> list[Finding]:
    if plat.problem is not None:  # npu-smi is there but failed, hung or printed no NPU table
        return [Finding("platform", FAIL, plat.problem, NPU_SMI_BROKEN)]
    if plat.target == "unknown":
        return [Finding("platform", FAIL, plat.detail, "report `npu-smi info` output; pass the target explicitly")]
    findings = [Finding("platform", OK, f"{plat.detail}; expected stack: target {target}")]
    if built is not None and built["target"] != plat.target:
        status = WARN if plat.kind != "ascend" else FAIL
        findings.append(
            Finding(
                "platform.image",
                status,
                f"this environment was built for target {built['target']} but the node is {plat.target}",
                f"use the verl-npu image built for {plat.target} (docker/Dockerfile.{plat.target})"
                if plat.target in NPU_TARGETS
                else "expected when inspecting an Ascend image on a non-Ascend machine",
            )
        )
    return findings
