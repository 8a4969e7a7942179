"""Which chip this node has, from ``npu-smi info`` / ``nvidia-smi -L``: the one detector.

install.sh (``python -m verl_npu.stack detect-target``, before anything is installed), ``verl-npu
doctor`` and ``verl_npu.platform`` read the node through this module. Standard library only.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence

KINDS = ("ascend", "cuda", "cpu")
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"
UNKNOWN = "unknown"  # the target of an Ascend node whose chip is neither 910B nor 910_93

# "A3" only as a word of its own: a PCI Bus-Id such as 0000:A3:00.0 on a 910B node is not A3.
_A3 = re.compile(r"910_93|(?<![\w:])A3(?![\w:])")
_A2 = re.compile(r"910B")
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+\S*910", flags=re.M)
_CHIP_NAME = re.compile(r"^\|\s*\d+\s+(\S+)\s*\|", flags=re.M)
NEITHER = "the chip is neither 910B nor 910_93"

Run = Callable[[Sequence[str]], "str | None"]


class UnknownChipError(RuntimeError):
    """npu-smi is there, but what it prints is not a chip verl-npu has a stack for."""


def run_command(argv: Sequence[str]) -> str | None:
    """stdout of ``argv`` when it is on PATH and succeeds within 30 s, else None."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def npu_device_files(pattern: str = NPU_DEVICE_FILES) -> list[str]:
    """The NPU device nodes of this node or container (what Ray also counts when acl is absent)."""
    return sorted(glob.glob(pattern))


def chip_target(npu_smi: str) -> str:
    """a3 or a2 from ``npu-smi info`` output; ``unknown`` for any other chip."""
    if _A3.search(npu_smi):
        return "a3"
    if _A2.search(npu_smi):
        return "a2"
    return UNKNOWN


def npu_count(npu_smi: str) -> int | None:
    """The 910-family NPUs ``npu-smi info`` lists, or None when it lists none."""
    return len(set(_NPU_ROW.findall(npu_smi))) or None


@dataclasses.dataclass(frozen=True)
class Platform:
    kind: str  # ascend | cuda | cpu
    target: str  # a2 | a3 | dev | unknown
    detail: str
    devices: int | None = None  # NPUs or GPUs listed by npu-smi / nvidia-smi


def detect_platform(run: Run = run_command) -> Platform:
    """The node as ``npu-smi info`` (first) or ``nvidia-smi -L`` shows it; CPU when neither answers."""
    npu = run(["npu-smi", "info"])
    if npu is not None:
        count = npu_count(npu)
        shown = count or "?"
        target = chip_target(npu)
        if target == "a3":
            return Platform("ascend", "a3", f"Ascend 910C (A3), {shown} NPU(s) from npu-smi", count)
        if target == "a2":
            return Platform("ascend", "a2", f"Ascend 910B (A2), {shown} NPU(s) from npu-smi", count)
        return Platform("ascend", UNKNOWN, f"npu-smi answered but {NEITHER}", count)
    gpus = run(["nvidia-smi", "-L"])
    if gpus:
        # `nvidia-smi -L` lists MIG instances indented under their GPU; count GPUs only.
        names = [line.split(":", 1)[1].split("(")[0].strip() for line in gpus.splitlines() if line.startswith("GPU ")]
        return Platform("cuda", "dev", f"CUDA, {len(names)} GPU(s): {', '.join(sorted(set(names)))}")
    return Platform("cpu", "dev", "CPU only (no npu-smi, no nvidia-smi)")


def detect_target(run: Run = run_command, which: Callable[[str], str | None] = shutil.which) -> str:
    """The install target of this node: a2 / a3 where npu-smi is on PATH, else dev.

    Raises UnknownChipError where npu-smi is there but fails or shows another chip: installing the
    dev stack on an Ascend node would be wrong, and guessing a chip worse.
    """
    if which("npu-smi") is None:
        return "dev"
    out = run(["npu-smi", "info"])
    if out is None:
        raise UnknownChipError(
            "npu-smi is on PATH but `npu-smi info` failed or timed out (driver not mounted?); "
            "pass --target a2 or --target a3"
        )
    target = chip_target(out)
    if target == UNKNOWN:
        names = sorted(set(_CHIP_NAME.findall(out))) or ["none recognised"]
        raise UnknownChipError(
            f"npu-smi is present but {NEITHER} (910B: a2, 910_93: a3; chips listed: {', '.join(names)}); "
            "pass --target a2 or --target a3"
        )
    return target
