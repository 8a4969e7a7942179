"""Stack rules on the installed sources: build-time patches, one copy of each module, the recorded contracts."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_npu import processes
from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS, REPO_ROOT, Stack

GIT_TIMEOUT_S = 120.0  # `git apply --check` of one patch


def check_patches(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    """Each build-time patch is still applied to the installed copy of its package."""
    findings = []
    for pkg in stack.packages_for(target):
        for rel in pkg.patches:
            check = f"patch.{pkg.name}"
            patch = REPO_ROOT / rel
            if not patch.is_file() or shutil.which("git") is None:
                findings.append(Finding(check, WARN, f"cannot verify {rel} (patch file or git missing here)"))
                continue
            touched = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
            top = touched[0].split("/", 1)[0] if touched else pkg.name
            # A package's origin is .../site-packages/top/__init__.py; a namespace package's is the dir.
            roots = [
                str(Path(origin).parent.parent if origin.endswith(".py") else Path(origin).parent)
                for origin in probe.module_locations(top)
            ]
            if not roots:
                findings.append(
                    Finding(check, FAIL, f"{pkg.name} is not installed, so {rel} is not applied", "bash install.sh")
                )
                continue
            done = processes.run(
                ["git", "apply", "--reverse", "--check", str(patch)],
                cwd=roots[0],
                env={**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(roots[0]).parent)},
                timeout=GIT_TIMEOUT_S,
            )
            if done.timed_out:
                findings.append(Finding(check, WARN, f"cannot verify {rel}: {done.describe()}"))
            elif done.returncode == 0:
                findings.append(Finding(check, OK, f"{Path(rel).name} applied in {roots[0]}"))
            else:
                findings.append(
                    Finding(
                        check,
                        FAIL,
                        f"{Path(rel).name} is not applied to {pkg.name} in {roots[0]} (reinstalled from PyPI?)",
                        f"rerun install.sh (it builds {pkg.requirement} from source with the patch)",
                    )
                )
    return findings


def check_modules(probe: Probe, stack: Stack, target: str) -> list[Finding]:
    findings = []
    megatron = probe.module_locations("megatron.core")
    if not megatron:
        findings.append(
            Finding(
                "module.megatron.core", FAIL, "megatron.core is not importable", f"bash install.sh --target {target}"
            )
        )
    elif len(megatron) > 1:
        findings.append(
            Finding(
                "module.megatron.core",
                FAIL,
                f"two copies of Megatron on sys.path: {'; '.join(megatron)} "
                "(the first wins, patches may hit the other)",
                "uninstall all but one: pip uninstall megatron-core, and remove Megatron-LM checkouts from PYTHONPATH",
            )
        )
    else:
        findings.append(Finding("module.megatron.core", OK, megatron[0]))

    for module, owner in (("megatron_adaptor", "megatron-adaptor"), ("transformer_engine", "transformer-engine-npu")):
        where = probe.module_locations(module)
        if target in NPU_TARGETS:
            if not where:
                findings.append(
                    Finding(
                        f"module.{module}",
                        FAIL,
                        f"{module} not importable ({owner} missing)",
                        f"bash install.sh --target {target}",
                    )
                )
            elif len(where) > 1:
                findings.append(
                    Finding(
                        f"module.{module}",
                        FAIL,
                        f"several copies: {'; '.join(where)}",
                        "keep only the one from install.sh",
                    )
                )
            else:
                findings.append(Finding(f"module.{module}", OK, where[0]))
        else:
            findings.append(Finding(f"module.{module}", OK, where[0] if where else "not installed (Ascend only)"))
    nvidia_te = [
        d for d in ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12") if probe.version(d)
    ]
    if target in NPU_TARGETS and nvidia_te:
        findings.append(
            Finding(
                "module.transformer_engine",
                FAIL,
                f"NVIDIA TransformerEngine ({', '.join(nvidia_te)}) "
                "collides with TransformerEngineNPU's `transformer_engine`",
                f"pip uninstall -y {' '.join(nvidia_te)}",
            )
        )
    return findings


def _component_root(probe: Probe, import_name: str) -> Path | None:
    locations = probe.module_locations(import_name)
    if not locations:
        return None
    origin = Path(locations[0])
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


def check_contracts(probe: Probe, target: str, registry: Sequence[Any] | None = None) -> list[Finding]:
    """The recorded facts about MindSpeed, vllm-ascend, torch-npu and vLLM (``registry``, default: all
    of verl_npu.contracts), against the sources installed where the probe looks."""
    from verl_npu import contracts
    from verl_npu.contracts.verify import IMPORT_NAMES, verify

    registry = contracts.ALL if registry is None else registry
    roots = {c: _component_root(probe, IMPORT_NAMES[c]) for c in contracts.COMPONENTS}
    present = [c for c, root in roots.items() if root is not None]
    absent = [c for c in contracts.COMPONENTS if c not in present]
    findings = []
    if absent:
        status = FAIL if target in NPU_TARGETS else OK
        detail = f"{', '.join(absent)} not installed" + ("" if status == FAIL else " (Ascend only)")
        fix = f"bash install.sh --target {target}" if status == FAIL else ""
        findings.append(Finding("contracts.installed", status, detail, fix))
    failed = [r for r in verify(registry, roots, components=present) if not r.ok]
    for result in failed:
        findings.append(
            Finding(
                f"contracts.{result.contract.id}",
                FAIL,
                f"{result.contract.component}: {result.contract.where}: {result.detail}",
                "the installed source is not the pinned one: rebuild the image, or review the change "
                "(docs/ascend_contracts.md)",
            )
        )
    if present and not failed:
        checked = sum(c.component in present for c in registry)
        findings.append(Finding("contracts", OK, f"{checked} recorded facts hold in {', '.join(present)}"))
    return findings
