"""The network hook: the node's HCCL / Ray network checks (verl_npu.cluster.network) on Ascend targets."""

from __future__ import annotations

from verl_npu.checks import OK
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS
from verl_npu.stack.detect import Platform


def check_network_hook(probe: Probe, plat: Platform, target: str) -> list[Finding]:
    """The probe's network checks where HCCL matters (Ascend targets or nodes); a note elsewhere."""
    if probe.network is None:
        return []
    if target in NPU_TARGETS or plat.kind == "ascend":
        return probe.network(probe.env)
    return [Finding("network", OK, "not checked on a dev target: HCCL and the cluster's interfaces "
                    "matter on Ascend nodes (python -m verl_npu.cluster.network check)")]  # fmt: skip
