"""Which chip this node has, from ``npu-smi info`` / ``nvidia-smi -L``: the one detector.

install.sh (``python -m verl_npu.stack detect-target``, before anything is installed), ``verl-npu
doctor`` and ``verl_npu.platform`` read the node through this module. Standard library only.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
from collections.abc import Callable, Sequence

from verl_npu import inputs, processes

KINDS = ("ascend", "cuda", "cpu")
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"
UNKNOWN = "unknown"  # the target of an Ascend node whose chip is neither 910B nor 910_93

# "A3" only as a word of its own: a PCI Bus-Id such as 0000:A3:00.0 on a 910B node is not A3.
_A3 = re.compile(r"910_93|(?<![\w:])A3(?![\w:])")
_A2 = re.compile(r"910B")
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+\S*910", flags=re.M)
_CHIP_NAME = re.compile(r"^\|\s*\d+\s+(\S+)\s*\|", flags=re.M)
NEITHER = "the chip is neither 910B nor 910_93"
COMMAND_TIMEOUT_S = 30.0  # npu-smi / nvidia-smi; a driver that does not answer in 30 s is broken
TIMEOUT_ENV = "VERL_NPU_PROBE_TIMEOUT_S"  # overrides it (a slow node; the tests' hanging npu-smi)


@dataclasses.dataclass(frozen=True)
class CommandFailed:
    """A tool that is on PATH but did not answer: it exited non-zero, timed out or could not be started."""

    argv: tuple[str, ...]
    returncode: int | None  # None: it did not finish within timeout_s (or could not be started)
    stderr_line: str  # the first line of its stderr ('' when it printed none)
    timeout_s: float | None = None

    def describe(self) -> str:
        """'`npu-smi info` exited 255: dcmi model initialized failed' (names the tool, the code or timeout, stderr)."""
        command = " ".join(self.argv)
        if self.returncode is None and self.timeout_s is not None:
            what = f"`{command}` did not answer within {self.timeout_s:g} s (killed)"
        elif self.returncode is None:
            what = f"`{command}` could not be started"
        elif self.returncode < 0:
            what = f"`{command}` was killed by signal {-self.returncode}"
        else:
            what = f"`{command}` exited {self.returncode}"
        return f"{what}: {self.stderr_line}" if self.stderr_line else f"{what} (no stderr)"


# What running a tool gives: its stdout, None when it is not on PATH, or how it failed.
Run = Callable[[Sequence[str]], "str | CommandFailed | None"]


class UnknownChipError(RuntimeError):
    """npu-smi is there, but what it prints is not a chip verl-npu has a stack for."""


def command_timeout() -> float:
    """The time limit of one npu-smi / nvidia-smi call: $VERL_NPU_PROBE_TIMEOUT_S, else 30 s."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return COMMAND_TIMEOUT_S
    return inputs.number(TIMEOUT_ENV, raw, above=0.0, maximum=3600.0, source="environment")


def run_command(argv: Sequence[str]) -> str | CommandFailed | None:
    """stdout of ``argv`` (decoded, undecodable bytes replaced); None when it is not on PATH; else how it failed.

    On a timeout its whole process group is ended (verl_npu.processes): a hung npu-smi is reported, not waited for.
    """
    if shutil.which(argv[0]) is None:
        return None
    timeout = command_timeout()
    try:
        done = processes.run(argv, timeout=timeout)
    except OSError as exc:
        return CommandFailed(tuple(argv), None, f"{type(exc).__name__}: {exc.strerror or exc}")
    if done.ok:
        return str(done.stdout)
    return CommandFailed(tuple(argv), None if done.timed_out else done.returncode, done.stderr_line(), timeout)


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
    # why an Ascend node's npu-smi could not be read (failed, timed out, unrecognised output); None when it was
    problem: str | None = None


def _first_line(text: str, limit: int = 120) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def detect_platform(run: Run = run_command) -> Platform:
    """The node as ``npu-smi info`` (first) or ``nvidia-smi -L`` shows it; CPU when neither is there.

    An npu-smi that is on PATH but fails, hangs or prints no NPU table makes an Ascend node of unknown
    target with a ``problem`` (the doctor fails it), never "CPU only".
    """
    npu = run(["npu-smi", "info"])
    if isinstance(npu, CommandFailed):
        problem = f"npu-smi is on PATH but {npu.describe()}"
        return Platform("ascend", UNKNOWN, problem, None, problem)
    if npu is not None:
        count = npu_count(npu)
        shown = count or "?"
        target = chip_target(npu)
        first = _first_line(npu)
        if not first:
            problem = "`npu-smi info` exited 0 but printed nothing"
            return Platform("ascend", UNKNOWN, problem, None, problem)
        if target == UNKNOWN:
            return Platform("ascend", UNKNOWN, f"npu-smi answered but {NEITHER}", count)
        if count is None:
            problem = f"`npu-smi info` exited 0 but printed no NPU table verl-npu recognises (first line: {first!r})"
            return Platform("ascend", UNKNOWN, problem, None, problem)
        if target == "a3":
            return Platform("ascend", "a3", f"Ascend 910C (A3), {shown} NPU(s) from npu-smi", count)
        return Platform("ascend", "a2", f"Ascend 910B (A2), {shown} NPU(s) from npu-smi", count)
    gpus = run(["nvidia-smi", "-L"])
    if isinstance(gpus, str) and gpus:
        # `nvidia-smi -L` lists MIG instances indented under their GPU; count GPUs only.
        names = [line.split(":", 1)[1].split("(")[0].strip() for line in gpus.splitlines()
                 if line.startswith("GPU ") and ":" in line]  # fmt: skip
        return Platform("cuda", "dev", f"CUDA, {len(names)} GPU(s): {', '.join(sorted(set(names)))}")
    if isinstance(gpus, CommandFailed):
        return Platform("cpu", "dev", f"CPU only (no npu-smi; {gpus.describe()})")
    return Platform("cpu", "dev", "CPU only (no npu-smi, no nvidia-smi)")


def detect_target(run: Run = run_command, which: Callable[[str], str | None] = shutil.which) -> str:
    """The install target of this node: a2 / a3 where npu-smi is on PATH, else dev.

    Raises UnknownChipError where npu-smi is there but fails or shows another chip: installing the
    dev stack on an Ascend node would be wrong, and guessing a chip worse.
    """
    if which("npu-smi") is None:
        return "dev"
    out = run(["npu-smi", "info"])
    if isinstance(out, CommandFailed):
        raise UnknownChipError(
            f"npu-smi is on PATH but `npu-smi info` failed: {out.describe()} (driver not mounted, or hung?); "
            "pass --target a2 or --target a3"
        )
    if out is None:
        raise UnknownChipError(
            "npu-smi is on PATH but `npu-smi info` failed or timed out (driver not mounted?); "
            "pass --target a2 or --target a3"
        )
    target = chip_target(out)
    if target != UNKNOWN and npu_count(out) is None:
        raise UnknownChipError(
            f"`npu-smi info` printed no NPU table verl-npu recognises (first line: {_first_line(out)!r}); "
            "pass --target a2 or --target a3"
        )
    if target == UNKNOWN:
        names = [_first_line(n, 40) for n in sorted(set(_CHIP_NAME.findall(out)))[:10]] or ["none recognised"]
        raise UnknownChipError(
            f"npu-smi is present but {NEITHER} (910B: a2, 910_93: a3; chips listed: {', '.join(names)}); "
            "pass --target a2 or --target a3"
        )
    return target
