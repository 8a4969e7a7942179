"""Stack rules: the CANN toolkit's environment and version, and the NPU driver."""

from __future__ import annotations

from pathlib import Path

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe, _read_version_file, _release
from verl_npu.stack import NPU_TARGETS, Stack
from verl_npu.stack.detect import Platform


def check_cann(probe: Probe, stack: Stack, plat: Platform, target: str) -> list[Finding]:
    if target not in NPU_TARGETS:
        return [Finding("cann", OK, "not needed on this platform")]
    findings = []
    home = probe.env.get("ASCEND_TOOLKIT_HOME") or probe.env.get("ASCEND_HOME_PATH")
    set_env = probe.ascend_root / "ascend-toolkit" / "set_env.sh"
    if not home:
        findings.append(
            Finding(
                "cann.env",
                FAIL,
                "CANN environment not set (ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH empty): "
                "torch_npu cannot load libhccl.so",
                f"source {set_env}  (the verl-npu image's entrypoint does this)",
            )
        )
    else:
        findings.append(Finding("cann.env", OK, f"ASCEND_TOOLKIT_HOME={home}"))
    expected = stack.chips[target].cann_version
    cann = None
    if home:
        for candidate in (Path(home) / "version.cfg", Path(home) / "compiler" / "version.info"):
            cann = cann or _read_version_file(candidate)
    driver = _read_version_file(probe.ascend_root / "driver" / "version.info")
    if cann is None:
        findings.append(
            Finding("cann.version", WARN if home else FAIL, "CANN version unreadable", f"install CANN {expected}")
        )
    elif _release(cann) != _release(expected):
        findings.append(
            Finding(
                "cann.version", FAIL, f"CANN {cann}, manifest expects {expected}", f"use the CANN {expected} base image"
            )
        )
    else:
        findings.append(Finding("cann.version", OK, f"CANN {cann}"))
    if plat.kind == "ascend":
        if driver is None:
            findings.append(
                Finding(
                    "cann.driver",
                    FAIL,
                    f"NPU driver version unreadable ({probe.ascend_root}/driver/version.info)",
                    "mount the host driver into the container: -v /usr/local/Ascend/driver:/usr/local/Ascend/driver",
                )
            )
        else:
            findings.append(
                Finding(
                    "cann.driver", OK, f"driver {driver} with CANN {cann or '?'} (check Ascend's compatibility table)"
                )
            )
    return findings
