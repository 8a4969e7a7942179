"""The mypy gate (verl_npu/ci/mypy_baseline.py): new errors and stale baseline entries fail, moved code does not,
``--write`` only shrinks the baseline, and issue 32's modules have no entry."""

from __future__ import annotations

import json
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.ci import mypy_baseline
from verl_npu.ci.mypy_baseline import KEPT_CLEAN, MypyDidNotFinish, compare, parse_mypy_json, read_baseline

# The modules issue 32 touched, brought to zero mypy errors; KEPT_CLEAN keeps them there.
ISSUE_32_MODULES = {
    "verl_npu/pipeline_split.py",
    "verl_npu/ops/fused_dsa_rules.py",
    "verl_npu/ops/ascend.py",
    "verl_npu/preflight/target.py",
    "verl_npu/parity/run_format.py",
    "verl_npu/parity/job.py",
    "verl_npu/cluster/network.py",
    "verl_npu/doctor/rules/network.py",
    "verl_npu/k8s/render.py",
    "verl_npu/engine/index_share.py",
    "verl_npu/engine/bridges/fast_read.py",
    "verl_npu/safetensors_header.py",
    "verl_npu/runtime_patches/mbridge_instance_mapping.py",
    "verl_npu/runtime_patches/dsa_index_share.py",
    "verl_npu/models/family.py",
    "verl_npu/models/glm5/config.py",
    "verl_npu/models/glm5/family.py",
    "verl_npu/preflight/compose.py",
    "verl_npu/preflight/verl_validation.py",
    "verl_npu/preflight/engine_checks.py",
    "verl_npu/preflight/model_shape.py",
    "verl_npu/preflight/worker.py",
    "verl_npu/preflight/pipeline.py",
    "verl_npu/preflight/values.py",
    "verl_npu/preflight/mesh.py",
    "verl_npu/preflight/memory.py",
    "verl_npu/preflight/memory_plan.py",
    "verl_npu/preflight/startup.py",
    "verl_npu/engine/build_plan.py",
    "verl_npu/parallelism.py",
}


def record(file: str, line: int, message: str, code: str | None = "arg-type", severity: str = "error") -> str:
    """One line of mypy's ``-O json`` output, with the fields mypy 2.4.1 writes."""
    return json.dumps(
        {"file": file, "line": line, "column": 4, "end_line": line, "end_column": 9, "message": message,
         "hint": None, "code": code, "severity": severity}
    )  # fmt: skip


ARG = 'Argument 1 to "f" has incompatible type "str"; expected "int"'
REDEF = 'Name "x" already defined on line {}'


def output(*records: str) -> str:
    return "".join(r + "\n" for r in records)


def write_baseline(path: Path, *records: str) -> Path:
    entries = read_baseline(path)  # empty: the file does not exist yet
    entries.update(error.entry for error in parse_mypy_json(output(*records)))
    path.write_text(mypy_baseline.render_baseline(entries))
    return path


def test_an_error_that_moved_still_matches_its_entry(tmp_path, capsys):
    baseline = write_baseline(
        tmp_path / "b.txt",
        record("verl_npu/a.py", 10, ARG),
        record("verl_npu/a.py", 12, REDEF.format(3), code="no-redef"),
    )
    moved = parse_mypy_json(
        output(record("verl_npu/a.py", 40, ARG), record("verl_npu/a.py", 47, REDEF.format(30), code="no-redef"))
    )
    assert mypy_baseline.check(moved, baseline) == 0
    assert "nothing new, nothing stale" in capsys.readouterr().out
    assert 'verl_npu/a.py: [no-redef] Name "x" already defined on line N' in baseline.read_text().splitlines()


def test_a_new_error_fails_and_is_printed_where_it_is_with_the_fix(tmp_path, capsys):
    baseline = write_baseline(tmp_path / "b.txt", record("verl_npu/a.py", 10, ARG))
    errors = parse_mypy_json(output(record("verl_npu/a.py", 10, ARG), record("verl_npu/b.py", 7, ARG, code="call-arg")))
    assert mypy_baseline.check(errors, baseline) == 1
    out = capsys.readouterr().out
    assert f"verl_npu/b.py:7: error: {ARG}  [call-arg]" in out
    assert "fix them" in out and "# type: ignore[<code>]" in out
    assert "no longer occur" not in out


def test_the_same_message_in_another_file_or_with_another_code_is_new(tmp_path):
    baseline = read_baseline(write_baseline(tmp_path / "b.txt", record("verl_npu/a.py", 10, ARG)))
    for other in (record("verl_npu/b.py", 10, ARG), record("verl_npu/a.py", 10, ARG, code="call-arg")):
        verdict = compare(parse_mypy_json(output(other)), baseline)
        assert len(verdict.new) == 1 and verdict.gone == [f"verl_npu/a.py: [arg-type] {ARG}"]


def test_a_fixed_error_fails_until_its_entry_is_removed(tmp_path, capsys):
    baseline = write_baseline(
        tmp_path / "b.txt",
        record("verl_npu/a.py", 10, ARG),
        record("verl_npu/a.py", 20, REDEF.format(1), code="no-redef"),
    )
    assert mypy_baseline.check(parse_mypy_json(output(record("verl_npu/a.py", 10, ARG))), baseline) == 1
    out = capsys.readouterr().out
    assert 'verl_npu/a.py: [no-redef] Name "x" already defined on line N' in out
    assert f"remove them from {baseline}" in out and "--write" in out
    assert "does not hold" not in out


def test_an_error_that_occurs_twice_takes_two_entries(tmp_path):
    once = record("verl_npu/a.py", 10, ARG)
    twice = read_baseline(write_baseline(tmp_path / "b.txt", once, record("verl_npu/a.py", 30, ARG)))
    assert twice[f"verl_npu/a.py: [arg-type] {ARG}"] == 2
    assert compare(parse_mypy_json(output(once)), twice).gone == [f"verl_npu/a.py: [arg-type] {ARG}"]
    thrice = parse_mypy_json(output(once, once, once))
    assert [e.line for e in compare(thrice, twice).new] == [10]


def test_notes_are_not_errors_and_anything_but_mypy_json_stops_the_check():
    errors = parse_mypy_json(
        output(
            record("verl_npu/a.py", 3, 'Revealed type is "int"', code="misc", severity="note"),
            record("verl_npu/a.py", 4, ARG),
        )
    )
    assert [(e.file, e.line) for e in errors] == [("verl_npu/a.py", 4)]
    with pytest.raises(MypyDidNotFinish, match=r"line 2 of its output .*unused section"):
        parse_mypy_json(
            record("verl_npu/a.py", 4, ARG) + "\npyproject.toml: note: unused section(s): module = ['x.*']\n"
        )


def test_write_drops_fixed_entries_and_refuses_new_ones_unless_allowed(tmp_path, capsys):
    old, fixed = record("verl_npu/a.py", 10, ARG), record("verl_npu/a.py", 20, REDEF.format(1), code="no-redef")
    baseline = write_baseline(tmp_path / "b.txt", old, fixed)
    before = baseline.read_text()
    new = record("verl_npu/c.py", 5, ARG)

    assert mypy_baseline.write(parse_mypy_json(output(old, new)), baseline, allow_new=False) == 1
    assert baseline.read_text() == before
    assert f"verl_npu/c.py:5: error: {ARG}" in capsys.readouterr().out

    assert mypy_baseline.write(parse_mypy_json(output(old)), baseline, allow_new=False) == 0
    assert read_baseline(baseline) == {f"verl_npu/a.py: [arg-type] {ARG}": 1}
    assert "1 removed, 0 added" in capsys.readouterr().out

    assert mypy_baseline.write(parse_mypy_json(output(old, new)), baseline, allow_new=True) == 0
    assert sorted(read_baseline(baseline)) == [f"verl_npu/a.py: [arg-type] {ARG}", f"verl_npu/c.py: [arg-type] {ARG}"]


def test_a_kept_clean_module_gets_no_entry_even_when_forced_and_none_may_be_written_in(tmp_path, capsys):
    clean = KEPT_CLEAN[0]
    baseline = write_baseline(tmp_path / "b.txt", record("verl_npu/a.py", 10, ARG))
    errors = parse_mypy_json(output(record("verl_npu/a.py", 10, ARG), record(clean, 3, ARG)))
    assert mypy_baseline.write(errors, baseline, allow_new=True) == 1
    assert clean not in baseline.read_text()
    assert f"{clean}:3: error" in capsys.readouterr().out
    # an entry written in by hand fails the check, though the error it names does occur
    baseline.write_text(baseline.read_text() + f"{clean}: [arg-type] {ARG}\n")
    assert mypy_baseline.check(errors, baseline) == 1
    assert "must stay free of mypy errors" in capsys.readouterr().out


def test_the_committed_baseline_is_what_write_writes_and_names_no_issue_32_module():
    path = REPO / mypy_baseline.BASELINE
    entries = read_baseline(path)
    assert path.read_text() == mypy_baseline.render_baseline(entries), "sorted, with the header: use --write"
    malformed = [e for e in entries if not re.fullmatch(r"verl_npu/[\w/]+\.py: \[[a-z-]+\] \S.*", e)]
    assert not malformed
    assert not [e for e in entries if re.search(r"\bline \d", e)], "line numbers in an entry break on any edit"
    assert set(KEPT_CLEAN) >= ISSUE_32_MODULES
    assert all((REPO / module).is_file() for module in KEPT_CLEAN)
    assert not [e for e in entries if e.partition(":")[0] in KEPT_CLEAN]


def test_ci_runs_the_check_with_the_pinned_mypy():
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert any(".venv/bin/python -m verl_npu.ci.mypy_baseline" in line for line in ci)
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    (pin,) = [d for d in dev if d.startswith("mypy==")]
    assert pin == f"mypy=={metadata.version('mypy')}", (
        "the baseline is the pinned mypy's output: reinstall the dev extras"
    )


def test_the_gate_runs_mypy_for_real(tmp_path, capsys):
    """mypy on a two-function package: its JSON as the gate reads it, moved code, a new error, a fix, a syntax error."""
    (tmp_path / "pyproject.toml").write_text('[tool.mypy]\npython_version = "3.12"\nfiles = ["pkg"]\n')
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "values.py"
    module.write_text('def one() -> int:\n    return "1"\n\n\ndef two() -> int:\n    return 2\n')
    baseline = tmp_path / "ci" / "mypy_baseline.txt"
    baseline.parent.mkdir()

    def gate(*args: str) -> int:
        return mypy_baseline._main(["--root", str(tmp_path), *args])

    assert gate("--write") == 1 and not baseline.exists()  # nothing recorded without --allow-new
    assert gate("--write", "--allow-new") == 0
    assert read_baseline(baseline) == {
        'pkg/values.py: [return-value] Incompatible return value type (got "str", expected "int")': 1
    }
    module.write_text("# a line above moves every error\n" + module.read_text())
    assert gate() == 0
    module.write_text(module.read_text().replace("return 2", 'return "2"'))
    capsys.readouterr()
    assert gate() == 1
    assert (
        'pkg/values.py:7: error: Incompatible return value type (got "str", expected "int")' in capsys.readouterr().out
    )
    module.write_text("def one() -> int:\n    return 1\n")
    assert gate() == 1
    assert "no longer occur" in capsys.readouterr().out
    module.write_text("def one(:\n")
    assert gate() == 2
    assert "mypy exited with status 2" in capsys.readouterr().err
