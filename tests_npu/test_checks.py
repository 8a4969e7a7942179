"""verl_npu.checks: the one ok / warn / fail vocabulary, its table and its JSON form (doctor, ci compare)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console

from verl_npu import checks, doctor
from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.ci import compare as cmp


def _text(table) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_the_vocabulary_and_its_summary() -> None:
    found = [Check("a", OK, "fine"), Check("b", WARN, "meh", "do x"), Check("c", FAIL, "bad", "do y")]
    assert checks.worst(c.status for c in found) == FAIL and checks.worst([]) == OK
    assert checks.counts(found) == {OK: 1, WARN: 1, FAIL: 1} and checks.failed(found)
    assert checks.summary(found) == "1 failed, 1 warnings, 1 ok"
    assert checks.to_json(found)[1] == {"check": "b", "status": "warn", "detail": "meh", "fix": "do x"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        found[0].status = FAIL  # type: ignore[misc]


def test_doctor_findings_are_checks_with_unchanged_json_keys() -> None:
    assert doctor.Finding is Check and (doctor.OK, doctor.WARN, doctor.FAIL) == (OK, WARN, FAIL)
    plat = doctor.Platform("cpu", "dev", "CPU only")
    report = doctor.Report(plat, "dev", [Check("x", WARN, "d", "f")])
    doc = json.loads(json.dumps(report.to_dict()))
    assert list(doc) == ["platform", "target", "ok", "findings"]
    assert doc["findings"] == [{"check": "x", "status": "warn", "detail": "d", "fix": "f"}] and doc["ok"] is True
    text = _text(report.table())
    assert report.table().title == "verl-npu doctor: CPU only (target dev)"
    assert all(h in text for h in ("check", "status", "detail", "fix"))
    assert report.summary() == "0 failed, 1 warnings, 0 ok"


def test_escape_keeps_brackets_in_text_cells_and_styles_the_status() -> None:
    rows = [Check("x", FAIL, "shape [b, s, k]", "pip install 'verl-npu[dev]'")]
    assert "verl-npu[dev]" in _text(checks.table(rows, "t", escape=True))
    assert checks.status_markup(FAIL) == "[bold red]fail[/]"
    assert checks.status_markup(FAIL, "FAIL") == "[bold red]FAIL[/]"


def test_ci_compare_rows_speak_the_vocabulary() -> None:
    bad = cmp.Row("perf/throughput", 100.0, 90.0, -10.0, "-5%", "regression")
    good = cmp.Row("timing_s/step", 10.0, 10.1, 0.1, "+5%", "ok")
    assert (bad.status, good.status) == (FAIL, OK) and checks.failed([bad.to_check(), good.to_check()])
    assert bad.to_check().check == "metric.perf/throughput"
    text = _text(cmp.table([bad, good], "job"))
    assert "REGRESSION" in text and all(h in text for h in ("metric", "baseline", "current", "delta", "limit"))
