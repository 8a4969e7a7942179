"""Platform rules: the node's chip (verl_npu.stack.detect) against the image, and the NPUs a job expects."""

from __future__ import annotations

from verl_npu import inputs
from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS, Stack, detect
from verl_npu.stack.detect import UNKNOWN, Platform, npus_phrase

EXPECT_NPUS_ENV = "VERL_NPU_EXPECT_NPUS"
MOUNT_NPUS = (
    "give the container the NPUs (/dev/davinci*, /dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc), the host "
    "driver (/usr/local/Ascend/driver) and npu-smi (/usr/local/sbin/npu-smi): on Kubernetes through the "
    "huawei.com/ascend-* resource and hostPath mounts (for Kubernetes-mode runners, in the runner's pod template: "
    "docker `options:` are ignored there); with docker, --device and -v"
)

DETECTION_DOC = detect.RULE_DOC
NPU_SMI_BROKEN = (
    "run `npu-smi info` on the node (as root, then in the container): a dcmi error or a hang means the NPU driver "
    "is not loaded or not mounted (check dmesg, /dev/davinci*, /usr/local/Ascend/driver and /usr/local/dcmi); "
    "report the output if it prints a table verl-npu does not read"
)


def detect_platform(probe: Probe) -> Platform:
    """The node as the probe's ``npu-smi`` / ``nvidia-smi`` show it (the one detector: verl_npu.stack.detect)."""
    return detect.detect_platform(probe.run)


def expected_npus(source: str, text: str) -> int:
    """The NPUs a job expects on a node, from ``--expect-npus`` or ``VERL_NPU_EXPECT_NPUS`` (``source``): ASCII
    decimal digits only (verl_npu.inputs), so that '١٦' is refused here as `verl-npu k8s render` refuses it."""
    return inputs.integer(source, text, minimum=1, maximum=inputs.MAX_DEVICES)


def check_expected_npus(probe: Probe, plat: Platform) -> list[Finding]:
    """Inside a job that expects NPUs (``--expect-npus``, else ``VERL_NPU_EXPECT_NPUS``), a node without them is a
    failure, not "CPU only".

    verl's vLLM rollout on NPU runs ``npu-smi`` with no fallback, so its absence fails the job later anyway.
    """
    if probe.expect_npus is not None:
        expected, source = probe.expect_npus, "--expect-npus"
    else:
        raw = probe.env.get(EXPECT_NPUS_ENV, "")
        if not raw.strip():
            return []
        try:
            expected, source = expected_npus(EXPECT_NPUS_ENV, raw), EXPECT_NPUS_ENV
        except inputs.InputError as exc:
            return [
                Finding(
                    "platform.expected-npus", FAIL, f"{EXPECT_NPUS_ENV}={raw!r}: expected {exc.allowed}",
                    f"set {EXPECT_NPUS_ENV} to the NPUs the job needs on this node (8 on A2, 16 on A3) in ASCII "
                    "digits, or unset it",
                )
            ]  # fmt: skip
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
                f"this job expects {expected} NPUs ({source}), but {seen}; the node looks like {plat.detail}",
                MOUNT_NPUS,
            )
        ]  # fmt: skip
    if plat.problem is not None:
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({source}), but {plat.problem}", NPU_SMI_BROKEN,
            )
        ]  # fmt: skip
    listed = npus_phrase(plat.devices, plat.cards or plat.devices) if plat.devices else "no NPU"
    if plat.devices is None or plat.devices < expected:
        return [
            Finding(
                "platform.expected-npus", FAIL,
                f"this job expects {expected} NPUs ({source}), npu-smi lists {listed}",
                "request all of the node's NPUs for the job (huawei.com/ascend-* limit, runner label) and check "
                "`npu-smi info` for NPUs in a bad state",
            )
        ]  # fmt: skip
    return [Finding("platform.expected-npus", OK, f"{listed}, {expected} expected")]


def check_platform(
    probe: Probe, stack: Stack, plat: Platform, target: str, built: dict | None, requested: str | None = None
) -> list[Finding]:
    """The node's chip against the target checked; ``requested``: the target `verl-npu doctor --target` names."""
    if plat.problem is not None:  # npu-smi is there but failed, hung or printed no NPU table
        return [Finding("platform", FAIL, plat.problem, NPU_SMI_BROKEN)]
    if requested is not None and plat.target in NPU_TARGETS and plat.target != requested:
        return [
            Finding(
                "platform", FAIL, f"--target {requested}, but npu-smi shows an {plat.target} node: {plat.detail}",
                f"leave --target out (doctor reads the node), or run on an {requested} node",
            )
        ]  # fmt: skip
    if plat.target == UNKNOWN and requested is None:
        return [
            Finding(
                "platform", FAIL, plat.detail,
                "if this node is an Atlas A2 or A3 node, `verl-npu doctor --target a2` (or a3) checks it against that "
                f"stack; report its `npu-smi info` output so the detection learns it ({DETECTION_DOC})",
            )
        ]  # fmt: skip
    if plat.target == UNKNOWN:
        return [
            Finding(
                "platform", WARN, f"{plat.detail}; checked as target {requested} because --target says so",
                f"report this node's `npu-smi info` output so the detection learns it ({DETECTION_DOC})",
            )
        ]  # fmt: skip
    source = " (--target)" if requested is not None else ""
    findings = [Finding("platform", OK, f"{plat.detail}; expected stack: target {target}{source}")]
    node = plat.target if plat.target in NPU_TARGETS else requested or plat.target
    if built is not None and built["target"] != node:
        status = WARN if plat.kind != "ascend" and requested is None else FAIL
        findings.append(
            Finding(
                "platform.image",
                status,
                f"this environment was built for target {built['target']} but "
                + (f"the node is {node}" if requested is None else f"--target says {node}"),
                f"use the verl-npu image built for {node} (docker/Dockerfile.{node})"
                if node in NPU_TARGETS
                else "expected when inspecting an Ascend image on a non-Ascend machine",
            )
        )
    return findings
