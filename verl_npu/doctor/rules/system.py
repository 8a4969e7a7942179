"""System rules: /dev/shm, open files and locked memory, each against a table of thresholds."""

from __future__ import annotations

import dataclasses
import os
import resource
from collections.abc import Callable, Sequence

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS

GIB = 1024**3
SHM_FIX = (
    "docker run --shm-size=64g (or --ipc=host); on Kubernetes an emptyDir with medium: Memory and "
    "sizeLimit 64Gi or more at /dev/shm"
)
SHM_MISSING_FIX = (
    "run the container with --shm-size=64g (or --ipc=host); on Kubernetes mount an emptyDir with "
    "medium: Memory at /dev/shm"
)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """A value under ``floor(probe)`` is ``status``; ``detail`` is formatted with the value's fields."""

    floor: Callable[[Probe], float | None]  # None: the rule does not apply on this probe
    status: str
    detail: str
    fix: str


# First match wins, so the strictest floor comes first.
SHM_THRESHOLDS = (
    Threshold(lambda probe: GIB, FAIL,
              "{path} is {gib:.2f} GiB: Ray object store and collective buffers need more", SHM_FIX),
    Threshold(lambda probe: 0.1 * probe.mem_total_bytes if probe.mem_total_bytes else None, WARN,
              "{path} is {gib:.1f} GiB, under 10% of {ram_gib:.0f} GiB RAM", "docker run --shm-size=<30% of RAM>"),
)  # fmt: skip
NOFILE_THRESHOLDS = (
    Threshold(lambda probe: 4096, FAIL, "open files limit {value}",
              "ulimit -n 1048576 (docker: --ulimit nofile=1048576:1048576)"),
    Threshold(lambda probe: 65536, WARN, "open files limit {value} (Ray with many workers wants >= 65536)",
              "ulimit -n 1048576"),
)  # fmt: skip


def _crossed(thresholds: Sequence[Threshold], probe: Probe, value: float) -> Threshold | None:
    for rule in thresholds:
        floor = rule.floor(probe)
        if floor is not None and value < floor:
            return rule
    return None


def check_shm(probe: Probe) -> list[Finding]:
    try:
        st = os.statvfs(probe.shm_path)
    except OSError:
        return [Finding("system.shm", FAIL, f"{probe.shm_path} is missing", SHM_MISSING_FIX)]
    shm = st.f_blocks * st.f_frsize
    rule = _crossed(SHM_THRESHOLDS, probe, shm)
    if rule is None:
        return [Finding("system.shm", OK, f"{probe.shm_path} {shm / GIB:.1f} GiB")]
    ram_gib = (probe.mem_total_bytes or 0) / GIB
    return [Finding("system.shm", rule.status, rule.detail.format(path=probe.shm_path, gib=shm / GIB,
                                                                  ram_gib=ram_gib), rule.fix)]  # fmt: skip


def check_nofile(probe: Probe) -> list[Finding]:
    nofile = probe.rlimits.get("nofile")
    if nofile is None:
        return []
    soft = nofile[0]
    rule = None if soft == resource.RLIM_INFINITY else _crossed(NOFILE_THRESHOLDS, probe, soft)
    if rule is None:
        shown = "unlimited" if soft == resource.RLIM_INFINITY else soft
        return [Finding("system.nofile", OK, f"open files limit {shown}")]
    return [Finding("system.nofile", rule.status, rule.detail.format(value=soft), rule.fix)]


def check_memlock(probe: Probe, target: str) -> list[Finding]:
    """Pinned host buffers (offload, HCCL) want locked memory unlimited: a warning on Ascend targets only."""
    memlock = probe.rlimits.get("memlock")
    if memlock is None:
        return []
    soft = memlock[0]
    if soft == resource.RLIM_INFINITY:
        return [Finding("system.memlock", OK, "locked memory unlimited")]
    detail = f"locked memory limit {soft // 1024} KiB"
    if target not in NPU_TARGETS:
        return [Finding("system.memlock", OK, detail, "")]
    detail += " (pinned host buffers for offload and HCCL need it unlimited)"
    return [Finding("system.memlock", WARN, detail, "docker run --ulimit memlock=-1:-1")]


def check_system(probe: Probe, target: str) -> list[Finding]:
    return check_shm(probe) + check_nofile(probe) + check_memlock(probe, target)
