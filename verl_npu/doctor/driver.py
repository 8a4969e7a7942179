"""The doctor's driver: every rule over one probe, in a fixed order, into a :class:`Report`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from verl_npu import checks
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.doctor.rules.build import check_build_manifest, read_built
from verl_npu.doctor.rules.cann import check_cann
from verl_npu.doctor.rules.env import check_allocator_env, check_external_modules, check_glm52_rollout_patch
from verl_npu.doctor.rules.installed import check_contracts, check_modules, check_patches
from verl_npu.doctor.rules.layer import check_layer, probe_layer
from verl_npu.doctor.rules.network import check_network_hook
from verl_npu.doctor.rules.platform import check_expected_npus, check_platform, detect_platform
from verl_npu.doctor.rules.system import check_system
from verl_npu.doctor.rules.versions import check_torch_pairing, check_triton, check_versions
from verl_npu.stack import NPU_TARGETS, Stack, load_stack
from verl_npu.stack.detect import UNKNOWN, Platform


@dataclasses.dataclass(frozen=True)
class Report:
    platform: Platform
    target: str
    findings: list[Finding]
    layer: dict | None = None  # what verl_npu.layer_probe saw (process and Ray worker), when it ran

    @property
    def failed(self) -> bool:
        return checks.failed(self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": dataclasses.asdict(self.platform),
            "target": self.target,
            "ok": not self.failed,
            "findings": checks.to_json(self.findings),
        }

    def table(self):
        """The findings as the shared check table (``verl-npu doctor`` prints it, then :meth:`summary`)."""
        return checks.table(self.findings, f"verl-npu doctor: {self.platform.detail} (target {self.target})")

    def summary(self) -> str:
        return checks.summary(self.findings)


def checked_target(plat: Platform, built: dict | None, requested: str | None = None) -> str:
    """The target the rules check: ``requested`` (`--target`), else the node's, else the image's (an Ascend
    image inspected without NPUs)."""
    if requested is not None:
        return requested
    target = plat.target if plat.target != UNKNOWN else (built or {}).get("target", "dev")
    if plat.kind != "ascend" and built is not None and built.get("target") in NPU_TARGETS:
        target = built["target"]
    return target


def diagnose(
    probe: Probe | None = None,
    stack: Stack | None = None,
    *,
    layer: bool = False,
    ray: bool = True,
    contracts: Sequence[Any] | None = None,
    target: str | None = None,
) -> Report:
    """Every rule over ``probe``; ``target`` (a2 or a3, `verl-npu doctor --target`) overrides the detected one."""
    if target is not None and target not in NPU_TARGETS:
        raise ValueError(f"target {target!r}: doctor checks a2 or a3 when told a target")
    requested = target
    probe = probe or Probe.current()
    stack = stack or load_stack()
    plat = detect_platform(probe)
    built, findings = read_built(probe)
    target = checked_target(plat, built, requested)
    findings += check_platform(probe, stack, plat, target, built, requested)
    findings += check_expected_npus(probe, plat)
    findings += check_versions(probe, stack, target)
    if not any(f.check == "build-manifest" for f in findings):
        findings += check_build_manifest(probe, stack, target, built)
    findings += check_cann(probe, stack, plat, target)
    findings += check_torch_pairing(probe, stack, target)
    findings += check_triton(probe, stack, target)
    findings += check_patches(probe, stack, target)
    findings += check_modules(probe, stack, target)
    findings += check_external_modules(probe, target)
    findings += check_allocator_env(probe, target)
    findings += check_glm52_rollout_patch(probe, target)
    findings += check_contracts(probe, target, contracts)
    findings += check_system(probe, target)
    findings += check_network_hook(probe, plat, target)
    seen = None
    if layer:
        seen, failed = probe_layer(probe, target, ray=ray)
        findings += failed if seen is None else check_layer(probe, target, report=seen)
    return Report(plat, target, findings, seen)
