"""`verl-npu ci compare` fails closed (issue 18): a gate never switches itself off on NaN, Infinity, a missing
metric or a malformed baseline, and ``--update`` / ``--json`` write whole files or none."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.ci import compare as cmp
from verl_npu.cli import main

BASE = {"perf/throughput": 1000.0, "timing_s/step": 60.0}
LIMITS = {
    "perf/throughput": {"kind": "relative", "max_decrease": 0.05},
    "timing_s/step": {"kind": "relative", "max_increase": 0.05},
}


def console_log(path: Path, steps: int = 15, override: dict[int, dict[str, str]] | None = None) -> Path:
    """verl's console logger lines; ``override``: step -> {metric: the text written for its value}."""
    lines = []
    for step in range(1, steps + 1):
        values = {k: repr(v) for k, v in BASE.items()} | (override or {}).get(step, {})
        lines.append(f"(TaskRunner pid=1) step:{step} - " + " - ".join(f"{k}:{v}" for k, v in values.items()))
    path.write_text("\n".join(lines) + "\n")
    return path


def jsonl_log(path: Path, steps: int = 15, override: dict[int, dict[str, str]] | None = None) -> Path:
    """verl's file logger lines; ``override``: step -> {metric: the JSON text written for its value}."""
    lines = []
    for step in range(1, steps + 1):
        values = {k: json.dumps(v) for k, v in BASE.items()} | (override or {}).get(step, {})
        data = ", ".join(f"{json.dumps(k)}: {v}" for k, v in values.items())
        lines.append(f'{{"step": {step}, "data": {{{data}}}}}')
    path.write_text("\n".join(lines) + "\n")
    return path


def baseline_file(path: Path, edit=None, *, raw: str | None = None) -> Path:
    data = {
        "job": "job",
        "window": {"first_step": 5, "last_step": 14},
        "metrics": {m: {"value": BASE[m], "limit": dict(LIMITS[m])} for m in BASE},
    }
    if edit is not None:
        edit(data)
    path.write_text(raw if raw is not None else json.dumps(data))
    return path


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["ci", "compare", *argv])
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def test_a_clean_log_passes(tmp_path):
    code, out, err = cli(str(console_log(tmp_path / "t.log")), str(baseline_file(tmp_path / "b.json")))
    assert code == 0 and "REGRESSION" not in out, err
    code, _, err = cli(str(jsonl_log(tmp_path / "t.jsonl")), str(baseline_file(tmp_path / "b.json")))
    assert code == 0, err


# --- the baseline ----------------------------------------------------------------------------------


def _set(*path_and_value):
    *keys, value = path_and_value

    def edit(data):
        node = data
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("raw_value", "field"),
    [
        ("NaN", "metrics.perf/throughput.value"),
        ("Infinity", "metrics.perf/throughput.value"),
        ("-Infinity", "metrics.perf/throughput.value"),
        ("1e999", "metrics.perf/throughput.value"),
    ],
)
def test_a_non_finite_baseline_value_is_an_error_naming_file_metric_and_field(tmp_path, raw_value, field):
    """json.loads reads NaN and Infinity; a NaN baseline made every comparison false, so every metric passed."""
    text = json.dumps(
        {"job": "job", "window": {"first_step": 5, "last_step": 14},
         "metrics": {m: {"value": "@" + m, "limit": LIMITS[m]} for m in BASE}}
    ).replace('"@perf/throughput"', raw_value).replace('"@timing_s/step"', "60.0")  # fmt: skip
    baseline = baseline_file(tmp_path / "b.json", raw=text)
    code, out, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and "ok" not in out
    assert str(baseline) in err and field in err, err


@pytest.mark.parametrize(
    ("raw_limit", "field"),
    [
        ('{"kind": "relative", "max_decrease": NaN}', "metrics.perf/throughput.limit.max_decrease"),
        ('{"kind": "relative", "max_decrease": Infinity}', "metrics.perf/throughput.limit.max_decrease"),
        ('{"kind": "absolute", "tolerance": Infinity}', "metrics.perf/throughput.limit.tolerance"),
        ('{"kind": "relative", "max_decrease": -0.05}', "metrics.perf/throughput.limit.max_decrease"),
        ('{"kind": "relative", "max_decrease": "5%"}', "metrics.perf/throughput.limit.max_decrease"),
        ('{"kind": "relative", "max_decrease": true}', "metrics.perf/throughput.limit.max_decrease"),
        ('{"kind": "absolute", "max_increase": 1e300}', "metrics.perf/throughput.limit.max_increase"),
        ('{"kind": ["relative"], "max_decrease": 0.05}', "metrics.perf/throughput.limit"),
        ("[0.05]", "metrics.perf/throughput.limit"),
    ],
)
def test_a_non_finite_or_malformed_limit_is_an_error(tmp_path, raw_limit, field):
    text = json.dumps(
        {"job": "job", "window": {"first_step": 5, "last_step": 14},
         "metrics": {"perf/throughput": {"value": 1000.0, "limit": "@"}}}
    ).replace('"@"', raw_limit)  # fmt: skip
    baseline = baseline_file(tmp_path / "b.json", raw=text)
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and str(baseline) in err and field in err, err


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("window", "first_step", 10**18), "window.first_step"),
        (_set("window", "last_step", 10**9), "window.last_step"),  # a window of a billion steps: bounded
        (_set("window", "first_step", 5.5), "window.first_step"),
        (_set("window", "first_step", True), "window.first_step"),
        (_set("window", "last_step", 4), "window.last_step"),
        (_set("window", "first_step", 0), "window.first_step"),
        (_set("window", [5, 14]), "window must be"),
        (_set("job", ["a"]), "job"),
        (_set("job", "x" * 10000), "job"),
        (_set("metrics", []), "metrics must be"),
        (_set("metrics", {}), "metrics must be"),
        (_set("metrics", "perf/throughput", 1000.0), "metrics.perf/throughput needs 'value'"),
        (_set("metrics", "perf/throughput", "value", [1000.0]), "metrics.perf/throughput.value"),
        (_set("metrics", "perf/throughput", "value", 1e300), "metrics.perf/throughput.value"),
        (_set("image", 42), "image"),
        (lambda d: d["metrics"].update({"x" * 5000: d["metrics"]["perf/throughput"]}), "metric name"),
        (lambda d: d.pop("metrics"), "missing top-level key 'metrics'"),
    ],
)
def test_a_malformed_baseline_is_an_error_naming_the_field(tmp_path, edit, field):
    baseline = baseline_file(tmp_path / "b.json", edit)
    code, out, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and out == "" and str(baseline) in err and field in err, err
    assert len(err) < 3000


@pytest.mark.parametrize("raw", ["[1, 2]", "null", '"text"', "[" * 100000, "\udcff"])
def test_a_baseline_that_is_not_an_object_is_an_error(tmp_path, raw):
    baseline = tmp_path / "b.json"
    baseline.write_bytes(raw.encode("utf-8", errors="surrogateescape"))
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and str(baseline) in err, err


def test_a_pending_baseline_value_never_passes(tmp_path):
    baseline = baseline_file(tmp_path / "b.json", _set("metrics", "timing_s/step", "value", None))
    code, out, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and out == "" and "no values taken yet for ['timing_s/step']" in err


# --- the log window ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "np.float64(nan)", "1e999"])
def test_a_non_finite_value_in_the_console_window_is_an_error(tmp_path, value):
    log = console_log(tmp_path / "t.log", override={9: {"timing_s/step": value}})
    code, out, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and out == "" and "metric 'timing_s/step' is nan/inf at steps [9] of the window 5-14" in err, err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1" + "0" * 400])
def test_a_non_finite_value_in_the_jsonl_window_is_an_error(tmp_path, value):
    log = jsonl_log(tmp_path / "t.jsonl", override={5: {"perf/throughput": value}})
    code, out, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and out == "" and "metric 'perf/throughput' is nan/inf at steps [5]" in err, err


def test_values_outside_the_window_do_not_matter(tmp_path):
    log = console_log(tmp_path / "t.log", override={2: {"timing_s/step": "nan"}, 15: {"perf/throughput": "inf"}})
    assert cli(str(log), str(baseline_file(tmp_path / "b.json")))[0] == 0


@pytest.mark.parametrize("value", ['"nan"', '"1000"', "null", "true", "[1000]", '{"v": 1000}'])
def test_a_metric_that_is_not_a_number_in_the_window_is_missing_not_skipped(tmp_path, value):
    log = jsonl_log(tmp_path / "t.jsonl", override={14: {"perf/throughput": value}})
    code, out, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and out == "", err
    assert "metric 'perf/throughput' is missing at steps [14] of the window 5-14" in err, err


def test_a_metric_missing_from_one_step_of_the_window_is_an_error(tmp_path):
    log = tmp_path / "t.log"
    console_log(log)
    lines = log.read_text().splitlines()
    lines[6] = lines[6].replace(" - timing_s/step:60.0", "")  # step 7
    log.write_text("\n".join(lines) + "\n")
    code, _, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and "metric 'timing_s/step' is missing at steps [7]" in err, err


def test_huge_finite_values_do_not_overflow_the_mean(tmp_path):
    """Ten values of 1e308 sum to infinity; their mean is 1e308, a finite regression, not an 'ok'."""
    log = console_log(tmp_path / "t.log", override={s: {"timing_s/step": "1e308"} for s in range(1, 16)})
    code, out, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 1 and "REGRESSION" in out, out + err


@pytest.mark.parametrize(
    "line",
    [
        "step:" + "9" * 5000 + " - perf/throughput:1",
        '{"step": 1e400, "data": {}}',
        '{"step": NaN, "data": {}}',
        '{"step": "five", "data": {}}',
        '{"step": -1, "data": {}}',
        '{"step": 3, "data": ' + "[" * 100000,
        "{" + "[" * 100000,
    ],
)
def test_a_garbage_line_is_an_error_naming_the_line_not_a_traceback(tmp_path, line):
    log = console_log(tmp_path / "t.log")
    log.write_text(log.read_text() + line + "\n")
    code, _, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and f"{log}:16" in err, err


def test_markup_in_metric_and_job_names_is_shown_as_text(tmp_path):
    global BASE
    saved = BASE
    BASE = {"[bold]x[/]": 1.0, "[/]": 2.0}
    try:
        log = console_log(tmp_path / "t.log")
        baseline = tmp_path / "b.json"
        baseline.write_text(json.dumps({
            "job": "[red]job[/", "window": {"first_step": 5, "last_step": 14},
            "metrics": {m: {"value": v, "limit": {"kind": "absolute", "tolerance": 0.1}} for m, v in BASE.items()},
        }))  # fmt: skip
        code, out, err = cli(str(log), str(baseline))
    finally:
        BASE = saved
    assert code == 0 and "[bold]x[/]" in out, out + err


# --- --update and --json --------------------------------------------------------------------------------


def test_update_refuses_a_value_the_baseline_cannot_hold_and_leaves_the_file(tmp_path):
    baseline = baseline_file(tmp_path / "b.json")
    before = baseline.read_bytes()
    huge = console_log(tmp_path / "t.log", override={s: {"perf/throughput": "1e300"} for s in range(1, 16)})
    code, _, err = cli(str(huge), str(baseline), "--update")
    assert code == 2 and "metrics.perf/throughput.value" in err and "not written to" in err, err
    assert baseline.read_bytes() == before
    infinite = console_log(tmp_path / "i.log", override={7: {"timing_s/step": "inf"}})
    code, _, err = cli(str(infinite), str(baseline), "--update")
    assert code == 2 and "nan/inf at steps [7]" in err
    assert baseline.read_bytes() == before and "Infinity" not in baseline.read_text()


def test_update_writes_a_baseline_that_reads_back(tmp_path):
    baseline = baseline_file(tmp_path / "b.json", _set("metrics", "perf/throughput", "value", None))
    log = console_log(tmp_path / "t.log", override={s: {"perf/throughput": "1234.5"} for s in range(1, 16)})
    assert cli(str(log), str(baseline), "--update", "--image", "img", "--commit", "0123abc")[0] == 0
    taken = cmp.read_baseline(baseline)
    assert taken.values["perf/throughput"] == 1234.5 and taken.image == "img"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _disk_full_midway(monkeypatch):
    real_write = os.write

    def write(fd, data):
        real_write(fd, bytes(data[: max(1, len(data) // 2)]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)


def test_update_on_a_full_disk_leaves_the_old_baseline_intact(tmp_path, monkeypatch):
    baseline = baseline_file(tmp_path / "b.json")
    before = baseline.read_bytes()
    log = console_log(tmp_path / "t.log", override={s: {"perf/throughput": "900.0"} for s in range(1, 16)})
    _disk_full_midway(monkeypatch)
    code, _, err = cli(str(log), str(baseline), "--update")
    monkeypatch.undo()
    assert code == 2 and "No space left on device" in err and "the old file is intact" in err, err
    assert baseline.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "t.log"]  # no temporary file left


def test_update_into_a_missing_directory_is_refused_before_reading_the_log(tmp_path):
    code, _, err = cli(str(tmp_path / "absent.log"), str(tmp_path / "nodir" / "b.json"), "--update")
    assert code == 2 and f"directory {tmp_path / 'nodir'} does not exist" in err and "no such log file" not in err


def test_json_directory_is_checked_before_any_work(tmp_path):
    out = tmp_path / "missing" / "compare.json"
    code, _, err = cli(str(tmp_path / "absent.log"), str(tmp_path / "absent.json"), "--json", str(out))
    assert code == 2 and f"--json {out}: directory {out.parent} does not exist" in err, err


def test_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    log, baseline = console_log(tmp_path / "t.log"), baseline_file(tmp_path / "b.json")
    report = tmp_path / "compare.json"
    report.write_text('{"previous": true}\n')
    _disk_full_midway(monkeypatch)
    code, _, err = cli(str(log), str(baseline), "--json", str(report))
    monkeypatch.undo()
    assert code == 2 and "cannot write it (No space left on device)" in err
    assert report.read_text() == '{"previous": true}\n'
    assert cli(str(log), str(baseline), "--json", str(report))[0] == 0
    written = json.loads(report.read_text())
    assert written["regressions"] == 0 and all(math.isfinite(r["current"]) for r in written["rows"])


# --- what the review of the change found ------------------------------------------------------------------------------
def test_integers_beyond_pythons_digit_limit_are_named_errors_not_crashes(tmp_path):
    baseline = baseline_file(tmp_path / "b.json")
    log = tmp_path / "t.log"
    log.write_text('{"step": ' + "9" * 5000 + ', "data": {"perf/throughput": 1.0}}\n')
    code, _, err = cli(str(log), str(baseline))
    assert code == 2 and "t.log:1" in err and "Traceback" not in err, err
    big = baseline_file(
        tmp_path / "big.json", raw='{"job": "j", "window": {"first_step": 1, "last_step": ' + "9" * 5000 + "}}"
    )
    code, _, err = cli(str(console_log(tmp_path / "c.log")), str(big))
    assert code == 2 and "big.json: not valid JSON" in err, err


def test_update_of_a_baseline_with_nan_in_a_field_it_keeps_is_refused_and_leaves_the_file(tmp_path):
    baseline = baseline_file(tmp_path / "b.json")
    baseline.write_text(baseline.read_text()[:-1] + ', "notes": NaN}')
    before = baseline.read_bytes()
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline), "--update")
    assert code == 2 and "unknown keys ['notes']" in err, err  # a baseline holds no field the gate does not read
    assert baseline.read_bytes() == before


@pytest.mark.parametrize("which", ["log", "baseline"])
def test_a_fifo_as_log_or_baseline_is_refused_at_once(tmp_path, which):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    log, baseline = console_log(tmp_path / "t.log"), baseline_file(tmp_path / "b.json")
    args = (str(fifo), str(baseline)) if which == "log" else (str(log), str(fifo))
    code, _, err = cli(*args)
    assert code == 2 and "not a regular file" in err, err


# --- issue 29: never silently one of two values; --update writes only values a shell reads back as given -------------
def _restarted(path: Path, jsonl: bool = False) -> Path:
    """A run that stopped after step 8 and was restarted from step 3 into the same log: steps 3-8 twice, the
    second copy slower."""
    first = {s: {"timing_s/step": "60.0"} for s in range(1, 9)}
    again = {s: {"timing_s/step": "90.0"} for s in range(3, 16)}
    write = jsonl_log if jsonl else console_log
    a, b = write(path.with_suffix(".a"), 8, first), write(path.with_suffix(".b"), 15, again)
    lines = a.read_text().splitlines() + b.read_text().splitlines()[2:]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("jsonl", [False, True])
def test_a_restarted_run_appended_to_one_log_is_refused_naming_step_metric_and_both_lines(tmp_path, jsonl):
    log = _restarted(tmp_path / "t.log", jsonl)
    code, out, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and out == "", err
    assert "step 3" in err and "'timing_s/step'" in err and "line 3" in err and "line 9" in err, err
    assert "60" in err and "90" in err and "one run" in err, err


def test_a_step_repeated_with_the_same_values_is_read_once(tmp_path):
    """Nothing is chosen between two equal copies (a line printed twice): the log reads as without the copy."""
    log = console_log(tmp_path / "t.log")
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:9], lines[6], *lines[9:]]) + "\n")
    assert cmp.read_log(log) == cmp.read_log(console_log(tmp_path / "clean.log"))
    assert cli(str(log), str(baseline_file(tmp_path / "b.json")))[0] == 0


def test_one_step_split_over_two_lines_with_other_metrics_is_merged(tmp_path):
    """verl logs validation metrics at the step a resumed run starts from: other keys, no value is chosen."""
    log = console_log(tmp_path / "t.log")
    log.write_text(log.read_text() + "(TaskRunner pid=2) step:8 - val-core/acc:0.5\n")
    assert cmp.read_log(log)[8]["val-core/acc"] == 0.5
    assert cli(str(log), str(baseline_file(tmp_path / "b.json")))[0] == 0


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("step:16 - perf/throughput:1000.0 - perf/throughput:5.0", "'perf/throughput' two values on one line"),
        ('{"step": 16, "data": {"perf/throughput": 1000.0, "perf/throughput": 5.0}}', "'perf/throughput'"),
        ('{"step": 7, "step": 8, "data": {}}', "'step'"),
        ("step:16 - a:1 step:17 - a:2", "two step records"),
    ],
)
def test_two_values_on_one_line_are_refused_naming_the_line(tmp_path, line, named):
    log = console_log(tmp_path / "t.log")
    log.write_text(log.read_text() + line + "\n")
    code, _, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and f"{log}:16" in err and named in err, err


@pytest.mark.parametrize("step", ['"7"', "7.0", "true", "null", "[7]", '" 7"'])
def test_a_jsonl_step_must_be_a_json_integer(tmp_path, step):
    log = jsonl_log(tmp_path / "t.jsonl")
    log.write_text(log.read_text() + f'{{"step": {step}, "data": {{"perf/throughput": 1.0}}}}\n')
    code, _, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and f"{log}:16" in err and "step=" in err, err


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ('{"job": "a", "job": "b", "window": {"first_step": 5, "last_step": 14}, "metrics": @}', "'job'"),
        ('{"job": "j", "window": {"first_step": 5, "last_step": 14, "last_step": 6}, "metrics": @}', "'last_step'"),
        ('{"job": "j", "window": {"first_step": 5, "last_step": 14}, "metrics": @, "metrics": {}}', "'metrics'"),
    ],
)
def test_a_key_twice_in_a_baseline_object_is_refused(tmp_path, raw, named):
    metrics = json.dumps({m: {"value": BASE[m], "limit": LIMITS[m]} for m in BASE})
    baseline = baseline_file(tmp_path / "b.json", raw=raw.replace("@", metrics))
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and str(baseline) in err and named in err and "twice" in err, err


def test_a_key_twice_in_a_limit_is_refused(tmp_path):
    text = json.dumps({"job": "j", "window": {"first_step": 5, "last_step": 14},
                       "metrics": {"perf/throughput": {"value": 1000.0, "limit": "@"}}})  # fmt: skip
    raw = text.replace('"@"', '{"kind": "relative", "max_decrease": 0.05, "max_decrease": 0.9}')
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline_file(tmp_path / "b.json", raw=raw)))
    assert code == 2 and "'max_decrease'" in err and "twice" in err, err


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_set("schema_version", 2), "'schema_version'"),
        (_set("format", 2), "format=2"),
        (_set("format", "1"), "format='1'"),
        (_set("format", True), "format=True"),
        (_set("window", "step", 3), "window: unknown keys ['step']"),
        (_set("metrics", "perf/throughput", "tolerence", 0.2), "metrics.perf/throughput: unknown keys ['tolerence']"),
        (_set("metrics", "perf/throughput", "rtol", 0.1), "'rtol'"),
        (_set("metrics", "perf/throughput", "limit", "tolerence", 0.2), "'tolerence'"),
        (_set("metrics", "perf/throughput", "limit", "tolerance", 0.5), "tolerance"),  # with max_decrease: which?
        (_set("description", ["x"]), "description"),
        (_set("description", "two\nlines"), "description"),
        (_set("taken", "yesterday"), "taken"),
        (_set("source_log", 7), "source_log"),
        (_set("job", "a\u202eb"), "job"),
        (lambda d: d["metrics"].update({"x\ny": d["metrics"]["perf/throughput"]}), "metric name"),
    ],
)
def test_an_unknown_key_format_or_value_in_a_baseline_is_refused(tmp_path, edit, named):
    baseline = baseline_file(tmp_path / "b.json", edit)
    code, out, err = cli(str(console_log(tmp_path / "t.log")), str(baseline))
    assert code == 2 and out == "" and str(baseline) in err and named in err, err


def test_the_committed_baselines_still_load_and_format_1_is_accepted(tmp_path):
    committed = sorted((REPO / "ci" / "baselines").glob("*.json"))
    assert len(committed) >= 4
    for path in committed:
        assert cmp.read_baseline(path).job == path.stem
    baseline = baseline_file(tmp_path / "b.json", _set("format", 1))
    assert cli(str(console_log(tmp_path / "t.log")), str(baseline))[0] == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--image", "img\n:evil"),
        ("--image", "img:tag\r"),
        ("--image", "img tag"),
        ("--image", ""),
        ("--image", "Ghcr.io/Owner/Img:tag"),
        ("--image", "img:" + "t" * 200),
        ("--image", "img:tag\x00"),
        ("--image", "img@sha256:abc"),
        ("--commit", "0123abc\n"),
        ("--commit", "HEAD; rm -rf /"),
        ("--commit", "$(id)"),
        ("--commit", "../x"),
        ("--commit", "a" * 201),
        ("--commit", ""),
    ],
)
def test_update_refuses_an_image_or_commit_a_shell_would_read_differently(tmp_path, option, value):
    baseline = baseline_file(tmp_path / "b.json")
    before = baseline.read_bytes()
    code, _, err = cli(str(console_log(tmp_path / "t.log")), str(baseline), "--update", option, value)
    assert code == 2 and f"{option}={value!r}"[:60] in err, err
    assert baseline.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "t.log"]


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/verl-project/verl-npu:a3-0123456789ab-0123456789ab",
        "localhost:5000/verl-npu@sha256:" + "a" * 64,
        "registry.example.com:443/team/verl_npu__x:v1.2-rc.3@sha256:" + "0" * 64,
        "verl-npu",
        "unknown",
    ],
)
def test_update_takes_an_image_reference(tmp_path, image):
    baseline = baseline_file(tmp_path / "b.json")
    log = console_log(tmp_path / "t.log")
    code, _, err = cli(str(log), str(baseline), "--update", "--image", image, "--commit", "0123456789ab")
    assert code == 0, err
    taken = cmp.read_baseline(baseline)
    assert taken.image == image and taken.commit == "0123456789ab"
    assert json.loads(baseline.read_text())["format"] == 1


def test_update_refuses_a_log_whose_file_name_holds_a_line_break(tmp_path):
    baseline = baseline_file(tmp_path / "b.json")
    before = baseline.read_bytes()
    log = console_log(tmp_path / "t\n.log")
    code, _, err = cli(str(log), str(baseline), "--update")
    assert code == 2 and "source_log" in err, err
    assert baseline.read_bytes() == before


@pytest.mark.parametrize("value", ["\u0661\u0660\u0660\u0660", "\uff11\uff10\uff10\uff10", "1_000", "0x3e8"])
def test_a_console_value_in_another_script_is_refused_not_read_as_a_number(tmp_path, value):
    """float() reads Arabic-Indic and full-width digits and '1_000' as 1000; what verl prints is ASCII."""
    log = console_log(tmp_path / "t.log", override={9: {"perf/throughput": value}})
    code, _, err = cli(str(log), str(baseline_file(tmp_path / "b.json")))
    assert code == 2 and f"{log}:9" in err and "perf/throughput" in err, err
