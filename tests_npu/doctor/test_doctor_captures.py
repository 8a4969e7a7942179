"""The hardware captures under tests_npu/data/: each is listed with its source, and reads as recorded.

They are the only npu-smi / hccn_tool output the doctor, install.sh and check_npus.sh tests use
(tests_npu/support/doctor_env.py); docs/hardware_detection.md derives the A2/A3 rule from them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.doctor_env import CAPTURES, NPU_SMI_DATA, npu_smi_capture

from verl_npu.stack import detect

DATA = NPU_SMI_DATA.parent
SOURCES = (DATA / "SOURCES.md").read_text()
DATA_FILES = sorted(p.relative_to(DATA) for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCES.md")


@pytest.mark.parametrize("path", DATA_FILES, ids=str)
def test_every_capture_is_listed_with_the_thread_it_came_from(path: Path) -> None:
    rows = [line for line in SOURCES.splitlines() if line.startswith(f"| `{path.name}`")]
    assert len(rows) == 1, f"{path}: not listed (once) in tests_npu/data/SOURCES.md"
    assert re.search(r"https://github\.com/\S+", rows[0]), rows[0]


def test_every_npu_smi_capture_has_a_recorded_reading() -> None:
    assert sorted(CAPTURES) == sorted(str(p.name) for p in DATA_FILES if p.parent.name == "npu_smi")


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_a_capture_is_npu_smis_table_whole(name: str) -> None:
    """npu-smi prints fixed-width tables: a line of another width is a copying error, and a capture cut
    short (as some threads show them) would not end on a border line."""
    lines = npu_smi_capture(name).splitlines()
    assert {len(line) for line in lines} == {len(lines[0])}
    assert lines[0].startswith("+") and lines[-1].startswith("+") and lines[-1].endswith("+")
    assert "..." not in npu_smi_capture(name)


@pytest.mark.parametrize(("name", "expected"), sorted(CAPTURES.items()))
def test_a_capture_reads_as_its_sources_row_says(name: str, expected: tuple[str, int, int]) -> None:
    table = detect.read_npu_smi(npu_smi_capture(name))
    target, npus, cards = expected
    assert (table.target()[0], len(table.chips), table.cards) == expected
    row = next(line for line in SOURCES.splitlines() if line.startswith(f"| `{name}`"))
    reads_as = row.rstrip(" |").rsplit("|", 1)[1].strip()
    assert reads_as.startswith(target) and reads_as.endswith(
        f"{npus} NPUs on {cards} cards" if npus != cards else f"{npus} NPUs"
    ), reads_as
    assert f"| {table.version} |" in row
