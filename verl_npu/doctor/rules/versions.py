"""Stack rules: installed distributions against stack.toml, torch / torch_npu pairing, triton vs triton-ascend."""

from __future__ import annotations

from verl_npu.checks import FAIL, OK
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe, _canonical, _release
from verl_npu.stack import NPU_TARGETS, Stack, build_manifest


def check_versions(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    findings = []
    for dist, expected in sorted(stack.expected_versions(target).items()):
        copies = probe.distributions.get(_canonical(dist), [])
        fix = f"pip install '{dist}=={expected}'  (or rerun: bash install.sh --target {target})"
        if not copies:
            findings.append(Finding(f"version.{dist}", FAIL, f"not installed; manifest pins {expected}", fix))
            continue
        versions = sorted({v for v, _ in copies})
        if len(copies) > 1:
            where = "; ".join(f"{v} at {loc}" for v, loc in copies)
            findings.append(
                Finding(
                    f"version.{dist}",
                    FAIL,
                    f"{len(copies)} copies installed: {where}",
                    f"pip uninstall -y {dist}; {fix}",
                )
            )
        elif not build_manifest.same_version(versions[0], expected):
            findings.append(Finding(f"version.{dist}", FAIL, f"installed {versions[0]}, manifest pins {expected}", fix))
        else:
            findings.append(Finding(f"version.{dist}", OK, f"{versions[0]} (manifest {expected})"))
    return findings


def check_torch_pairing(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    torch = probe.version("torch")
    npu = probe.version("torch-npu")
    if npu is None:
        if target in NPU_TARGETS:
            return [Finding("torch.pairing", FAIL, "torch_npu is not installed", f"bash install.sh --target {target}")]
        return [Finding("torch.pairing", OK, "torch_npu not installed (not needed on this platform)")]
    if torch is None:
        return [Finding("torch.pairing", FAIL, f"torch_npu {npu} installed without torch", "bash install.sh")]
    if _release(torch) != _release(npu):
        pinned = stack.packages["torch"].version
        return [
            Finding(
                "torch.pairing",
                FAIL,
                f"torch {torch} with torch_npu {npu}: "
                f"torch_npu {_release(npu)}.x only works with torch {_release(npu)}",
                f"pip install 'torch=={pinned}' 'torch-npu=={stack.packages['torch-npu'].version}'",
            )
        ]
    return [Finding("torch.pairing", OK, f"torch {torch} with torch_npu {npu}")]


def check_triton(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    mainline = probe.version("triton")
    ascend = probe.version("triton-ascend")
    if ascend is None:
        if target in NPU_TARGETS:
            return [Finding("triton", FAIL, "triton-ascend is not installed", f"bash install.sh --target {target}")]
        return [Finding("triton", OK, f"mainline triton {mainline}" if mainline else "no triton installed")]
    if mainline is not None:
        return [
            Finding(
                "triton",
                FAIL,
                f"mainline triton {mainline} shadows triton-ascend {ascend}: both install the `triton` package",
                "pip uninstall -y triton && pip install --force-reinstall --no-deps "
                f"'triton-ascend=={stack.packages['triton-ascend'].version}'",
            )
        ]
    return [Finding("triton", OK, f"triton-ascend {ascend}")]
