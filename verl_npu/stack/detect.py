"""Which chip this node has, from ``npu-smi info`` / ``nvidia-smi -L``: the one detector.

install.sh (``python -m verl_npu.stack detect-target``, before anything is installed), ``verl-npu
doctor`` and ``verl_npu.platform`` read the node through this module. Standard library only.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import re
import shutil
from collections.abc import Callable, Sequence

from verl_npu import inputs, processes

KINDS = ("ascend", "cuda", "cpu")
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"
UNKNOWN = "unknown"  # the target of an Ascend node that npu-smi shows as neither an A2 nor an A3 node
RULE_DOC = "docs/hardware_detection.md"

# `npu-smi info` prints each chip as two rows (tests_npu/data/npu_smi/ holds real captures): a name row
# "| NPU  Name | Health | ..." and a chip row "| Chip [Phy-ID] | Bus-Id | ...". A chip row always carries a
# PCI Bus-Id; the process table below the chip table has rows of the same "| N  M |" shape but none.
# re.ASCII throughout: npu-smi prints ASCII, and a row numbered in other digits ('٣', which int() reads as 3) is
# not a chip row of a real npu-smi, so it is not counted as one.
_NAME_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|([^|]*)\|", re.ASCII)
_CHIP_ROW = re.compile(
    r"^\|\s*(\d+)(?:\s+(\d+))?\s*\|\s*([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*\|", re.ASCII
)
# The header's second row names the chip row's second number: "Phy-ID" on A3, "Device" on 310P, none on A2.
_CHIP_HEADER = re.compile(r"^\|\s*Chip\b(?:\s+(\S+))?\s*\|\s*Bus-Id", re.M | re.ASCII)
_PROCESS_HEADER = re.compile(r"^\|\s*NPU\s+Chip\s*\|\s*Process id", re.M | re.ASCII)
_VERSION = re.compile(r"npu-smi\s+\S+\s+Version:\s*(\S+)", re.ASCII)
_A2_NAME = re.compile(r"910B\d\w*", re.ASCII)  # 910B1, 910B2, 910B2C, 910B3, 910B4: Atlas A2's chips
_A3_NAME = "Ascend910"  # what npu-smi 24.1 to 25.2 prints for each die of an Atlas A3 card
NEITHER = "neither Atlas A2 (910B* chips) nor Atlas A3 (Ascend910 cards of two dies)"
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
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw.strip():
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


@dataclasses.dataclass(frozen=True)
class NpuChip:
    """One chip of `npu-smi info`: one NPU a job can be given (an A3 card holds two)."""

    npu: int  # the NPU column: the card
    chip: int  # the chip's index on its card: 0 on A2; 0 and 1 for the two dies of an A3 card
    device: int | None  # the chip row's second number (A3: Phy-ID, the id of /dev/davinciN); None on A2
    name: str
    health: str
    bus_id: str


@dataclasses.dataclass(frozen=True)
class NpuTable:
    """The chip table of `npu-smi info` (the process table below it is not read)."""

    chips: tuple[NpuChip, ...]
    id_column: str | None  # the header's name for the chip row's second number: "Phy-ID" (A3), "Device" (310P)
    version: str | None  # "25.2.1" from the banner

    @property
    def cards(self) -> int:
        return len({c.npu for c in self.chips})

    @property
    def names(self) -> list[str]:
        return sorted({c.name for c in self.chips})

    def target(self) -> tuple[str, str]:
        """(a2 | a3 | unknown, why), by the rule of docs/hardware_detection.md.

        A chip name alone does not say A2 or A3 (910B3 chips run in A2 servers too), so the layout
        decides with it: an A3 card is two dies, chip rows 0 and 1 under a Phy-ID column, named Ascend910.
        """
        per_card: dict[int, list[int]] = {}
        for c in self.chips:
            per_card.setdefault(c.npu, []).append(c.chip)
        names = self.names
        shown = ", ".join(_printable(n, 40) for n in names[:10])
        if names and all(_A2_NAME.fullmatch(n) for n in names):
            layout_ok = self.id_column is None and all(chips == [0] for chips in per_card.values())
            if layout_ok:
                return "a2", f"{shown} chips, one per NPU"
            return UNKNOWN, f"{shown} chips, but not one chip row (chip 0) per NPU as Atlas A2 lists them"
        if names == [_A3_NAME]:
            layout_ok = (
                self.id_column == "Phy-ID"
                and all(c.device is not None for c in self.chips)
                and all(len(set(chips)) == len(chips) and set(chips) <= {0, 1} for chips in per_card.values())
            )
            if layout_ok:
                return "a3", f"{shown} cards of two dies"
            return UNKNOWN, f"{shown} rows, but not as Atlas A3 lists its dies (chips 0 and 1 under a Phy-ID column)"
        return UNKNOWN, f"{shown} chips: {NEITHER}"


def read_npu_smi(text: str) -> NpuTable:
    """The chip table in `npu-smi info` output; no chips when it has none verl-npu recognises."""
    process_table = _PROCESS_HEADER.search(text)
    lines = (text[: process_table.start()] if process_table else text).splitlines()
    chips = []
    for first, second in itertools.pairwise(lines):
        name_row, chip_row = _NAME_ROW.match(first), _CHIP_ROW.match(second)
        if name_row and chip_row:
            device = int(chip_row.group(2)) if chip_row.group(2) is not None else None
            chips.append(
                NpuChip(
                    npu=int(name_row.group(1)),
                    chip=int(chip_row.group(1)),
                    device=device,
                    name=name_row.group(2),
                    health=name_row.group(3).strip() or "?",
                    bus_id=chip_row.group(3),
                )
            )
    header = _CHIP_HEADER.search(text)
    version = _VERSION.search(text)
    return NpuTable(tuple(chips), header.group(1) if header else None, version.group(1) if version else None)


@dataclasses.dataclass(frozen=True)
class Platform:
    kind: str  # ascend | cuda | cpu
    target: str  # a2 | a3 | dev | unknown
    detail: str
    devices: int | None = None  # NPUs (chips: an A3 card counts two) or GPUs listed by npu-smi / nvidia-smi
    # why an Ascend node's npu-smi could not be read (failed, timed out, unrecognised output); None when it was
    problem: str | None = None
    cards: int | None = None  # the NPU cards npu-smi lists (8 on an A3 node of 16 NPUs)


def _printable(text: str, limit: int) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def npus_phrase(devices: int, cards: int) -> str:
    """'16 NPUs on 8 cards (two dies each)' or '8 NPUs': doctor's line and its report say the same."""
    if cards and devices != cards:
        each = "two dies each" if devices == 2 * cards else f"{devices} chips in all"
        return f"{devices} NPUs on {cards} cards ({each})"
    return f"{devices} NPUs"


def _first_line(text: str, limit: int = 120) -> str:
    return _printable(next((ln.strip() for ln in text.splitlines() if ln.strip()), ""), limit)


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
        first = _first_line(npu)
        if not first:
            problem = "`npu-smi info` exited 0 but printed nothing"
            return Platform("ascend", UNKNOWN, problem, None, problem)
        table = read_npu_smi(npu)
        if not table.chips:
            problem = f"`npu-smi info` exited 0 but printed no NPU table verl-npu recognises (first line: {first!r})"
            return Platform("ascend", UNKNOWN, problem, None, problem)
        target, why = table.target()
        devices, cards = len(table.chips), table.cards
        source = f"from npu-smi {table.version}" if table.version else "from npu-smi"
        if target == UNKNOWN:
            return Platform("ascend", UNKNOWN, f"npu-smi lists {why}", devices, None, cards)
        generation = "Atlas A3" if target == "a3" else "Atlas A2"
        detail = f"{generation} ({', '.join(table.names)}), {npus_phrase(devices, cards)}, {source}"
        return Platform("ascend", target, detail, devices, None, cards)
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
    table = read_npu_smi(out)
    if not table.chips:
        raise UnknownChipError(
            f"`npu-smi info` printed no NPU table verl-npu recognises (first line: {_first_line(out)!r}); "
            "pass --target a2 or --target a3"
        )
    target, why = table.target()
    if target == UNKNOWN:
        raise UnknownChipError(
            f"npu-smi lists {why}; if this node is one of them, pass --target a2 or --target a3 "
            f"(how verl-npu tells them apart: {RULE_DOC})"
        )
    return target
