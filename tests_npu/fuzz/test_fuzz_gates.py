"""Hostile input to the gates (issue 18): `verl-npu ci compare`, doctor's npu-smi readers, the stack manifest.

Properties:
- ci compare: never a traceback (exit 0, 1 or 2 only: the ``run_cli`` fixture), and never a pass (exit 0 or 1)
  when a baseline value or limit is not a finite number, a field is missing, or a window value is not finite
  or not there;
- the gates never choose one of two values (issue 29): a step repeated with another value anywhere in a log, a
  JSON step that is not a JSON integer, an unknown key at any level of a baseline, a key twice in any JSON object
  of a baseline: never exit 0 (nor 1: nothing is judged); a step repeated with its same values reads as once;
  ``--update`` writes an ``--image`` / ``--commit`` only when it is one line of printable text, else nothing;
- npu-smi: any bytes npu-smi may print, and any way it may fail, read without an exception; the platform is an
  Ascend chip only when an NPU table was read, and output without one is never "ok";
- the manifest: a mutated copy of verl_npu/stack/stack.toml loads, or raises StackError; so do the install plan
  and the constraints built from it.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st

from verl_npu.checks import FAIL, OK
from verl_npu.ci import compare as cmp
from verl_npu.stack import MANIFEST_PATH, TARGETS, StackError, detect, load_stack
from verl_npu.stack.plan import install_plan

METRICS = ("perf/throughput", "timing_s/step")
GOOD_VALUE = {"perf/throughput": 1000.0, "timing_s/step": 60.0}

# --- ci compare: baselines --------------------------------------------------------------------------

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.just(10**400),
)
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=20), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))  # fmt: skip
ANY_VALUE = st.one_of(NUMBERS, JUNK)


def _bad_number(value) -> bool:
    """Not a finite real number (what no gate may pass on)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    try:
        return not math.isfinite(float(value))
    except OverflowError:
        return True


@st.composite
def baselines(draw):
    """(baseline JSON text, whether an input is non-finite, not a number or missing)."""
    bad = False
    metrics = {}
    for metric in draw(st.lists(st.sampled_from(METRICS), min_size=0, max_size=2, unique=True)):
        entry: dict = {}
        if draw(st.booleans()):
            value = GOOD_VALUE[metric] * draw(st.floats(0.5, 2.0))
        else:
            value = draw(ANY_VALUE)
            bad |= value is None or _bad_number(value)
        if draw(st.integers(0, 9)) > 0:
            entry["value"] = value
        else:
            bad = True
        kind = draw(st.one_of(st.sampled_from(["absolute", "relative"]), JUNK))
        limit: dict = {"kind": kind}
        bad |= kind not in ("absolute", "relative")
        amounts = draw(st.lists(st.sampled_from(["max_increase", "max_decrease", "tolerance"]), max_size=3,
                                unique=True))  # fmt: skip
        bad |= not amounts or ("tolerance" in amounts and len(amounts) > 1)  # tolerance and a bound: which one?
        for key in amounts:
            amount = draw(st.one_of(st.floats(0, 0.5), ANY_VALUE))
            bad |= _bad_number(amount)
            limit[key] = amount
        if draw(st.integers(0, 9)) > 0:
            entry["limit"] = limit
        else:
            bad = True
        metrics[metric] = entry
    bad |= not metrics
    window: dict = {}
    for key, good in (("first_step", 5), ("last_step", 14)):
        if draw(st.integers(0, 4)) > 0:
            window[key] = good
        elif draw(st.integers(0, 4)) > 0:
            window[key] = draw(st.one_of(st.integers(-(10**20), 10**20), ANY_VALUE))
    first, last = window.get("first_step"), window.get("last_step")
    # the log has steps 1-15: a window of whole steps inside it can pass; anything else is an error
    bad |= not (all(type(v) is int for v in (first, last)) and 1 <= first <= last <= 15)
    data = {"job": draw(st.one_of(st.just("job"), ANY_VALUE)), "window": window, "metrics": metrics}
    bad |= not isinstance(data["job"], str)
    for key in draw(st.lists(st.sampled_from(["job", "window", "metrics"]), max_size=1)):
        data.pop(key)
        bad = True
    return json.dumps(data), bad


def _console_log(path: Path, values: dict[int, dict[str, str]], garbage: list[str]) -> None:
    lines = [f"(TaskRunner pid=1) step:{step} - " + " - ".join(f"{k}:{v}" for k, v in row.items())
             for step, row in sorted(values.items())]  # fmt: skip
    for line in garbage:
        lines.insert(len(lines) // 2, line)
    path.write_text("\n".join(lines) + "\n", errors="surrogateescape")


def _clean(steps: int = 15) -> dict[int, dict[str, str]]:
    return {s: {m: repr(GOOD_VALUE[m]) for m in METRICS} for s in range(1, steps + 1)}


@given(baselines())
def test_ci_compare_never_passes_a_baseline_with_a_bad_or_missing_input(run_cli, baseline):
    text, bad = baseline
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        _console_log(log, _clean(), [])
        path.write_text(text)
        code, out, err = run_cli("ci", "compare", str(log), str(path))
    if bad:
        assert code == 2, (text, out, err)
        assert str(path) in err or "metric" in err, err


@given(baselines())
def test_ci_compare_update_never_writes_a_non_finite_baseline(run_cli, baseline):
    text, _ = baseline
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        _console_log(log, _clean(), [])
        path.write_text(text)
        code, _, err = run_cli("ci", "compare", str(log), str(path), "--update")
        after = path.read_text()
        names = sorted(p.name for p in Path(tmp).iterdir())
    assert names == ["b.json", "t.log"]  # no temporary file left, whatever happened
    if code != 0:
        assert after == text, err  # refused: the old file, whole
    else:
        assert "NaN" not in after and "Infinity" not in after


# --- ci compare: logs ----------------------------------------------------------------------------------

CELL = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "NaN", "np.float64(nan)", "1e999", "True", "", "1" * 500]),
    # not the separators of the console format (" - ", ":", a line break): those make other lines, not values
    st.text(st.characters(blacklist_characters=":-", blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12),
)
GARBAGE_LINE = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=80),
    st.binary(max_size=80).map(lambda b: b.decode("utf-8", errors="surrogateescape")),
    st.sampled_from(["{", '{"step": 1e400, "data": {}}', '{"step": 5, "data": []}', "[" * 5000,
                     '{"step": 5, "data": {"perf/throughput": NaN}}', "step:99999999999999999999999 - a:1"]),
)  # fmt: skip


@st.composite
def logs(draw):
    """(values per step as written, garbage lines, whether the window 5-14 holds a non-finite or missing value)."""
    values = _clean(draw(st.integers(10, 16)))
    for _ in range(draw(st.integers(0, 4))):
        step = draw(st.integers(1, 16))
        metric = draw(st.sampled_from(METRICS))
        if step in values:
            if draw(st.booleans()):
                values[step][metric] = draw(CELL)
            else:
                values[step].pop(metric, None)
    bad = False
    for step in range(5, 15):
        row = values.get(step, {})
        for metric in METRICS:
            cell = row.get(metric)
            try:
                number = None if cell is None else cmp._number(cell)  # the console reader's own scalar parser
            except ValueError:
                number = None
            bad |= number is None or not math.isfinite(number)
    garbage = draw(st.lists(GARBAGE_LINE, max_size=2))
    return values, garbage, bad


@given(logs(), st.booleans())
def test_ci_compare_never_passes_a_window_with_a_non_finite_or_missing_value(run_cli, log_case, jsonl):
    values, garbage, bad = log_case
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        if jsonl:
            lines = []
            for step, row in sorted(values.items()):
                data = {}
                for k, v in row.items():
                    try:
                        data[k] = float(v)
                    except ValueError:
                        data[k] = v
                lines.append(json.dumps({"step": step, "data": data}))
            lines[len(lines) // 2 : len(lines) // 2] = garbage
            log.write_text("\n".join(lines) + "\n", errors="surrogateescape")
        else:
            _console_log(log, values, garbage)
        limits = {"kind": "relative", "tolerance": 0.5}
        metrics = {m: {"value": GOOD_VALUE[m], "limit": limits} for m in METRICS}
        path.write_text(json.dumps({"job": "j", "window": {"first_step": 5, "last_step": 14}, "metrics": metrics}))
        code, out, err = run_cli("ci", "compare", str(log), str(path))
    if bad:
        assert code == 2, (values, garbage, out, err)


# --- the gates never choose one of two values (issue 29) --------------------------------------------------------
def _write_log(path: Path, records: list[tuple[object, dict[str, float]]], jsonl: bool) -> None:
    if jsonl:
        lines = [json.dumps({"step": step, "data": row}) for step, row in records]
    else:
        lines = [f"step:{step} - " + " - ".join(f"{k}:{v!r}" for k, v in row.items()) for step, row in records]
    path.write_text("\n".join(lines) + "\n")


def _baseline(path: Path) -> None:
    limits = {"kind": "relative", "tolerance": 0.5}
    metrics = {m: {"value": GOOD_VALUE[m], "limit": limits} for m in METRICS}
    path.write_text(json.dumps({"job": "j", "window": {"first_step": 5, "last_step": 14}, "metrics": metrics}))


def _gate(run_cli, records, jsonl: bool) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        _write_log(log, records, jsonl)
        _baseline(path)
        code, _, err = run_cli("ci", "compare", str(log), str(path))
    return code, err


def _clean_records(steps: int = 15) -> list[tuple[object, dict[str, float]]]:
    return [(s, dict(GOOD_VALUE)) for s in range(1, steps + 1)]


@given(st.integers(1, 15), st.integers(0, 15), st.sampled_from(METRICS), st.floats(0.5, 2.0).filter(lambda f: f != 1),
       st.booleans())  # fmt: skip
def test_a_step_given_again_with_another_value_anywhere_is_never_judged(run_cli, step, at, metric, factor, jsonl):
    records = _clean_records()
    again = dict(GOOD_VALUE)
    again[metric] *= factor
    records.insert(at, (step, again))
    code, err = _gate(run_cli, records, jsonl)
    assert code == 2 and f"step {step} gives {metric!r} two values" in err, err


@given(st.integers(1, 15), st.integers(0, 15), st.booleans())
def test_a_step_given_again_with_the_same_values_reads_as_once(step, at, jsonl):
    records = _clean_records()
    records.insert(at, (step, dict(GOOD_VALUE)))
    with tempfile.TemporaryDirectory() as tmp:
        log, clean = Path(tmp) / "t.log", Path(tmp) / "clean.log"
        _write_log(log, records, jsonl)
        _write_log(clean, _clean_records(), jsonl)
        assert cmp.read_log(log) == cmp.read_log(clean)


NOT_A_JSON_INTEGER = st.one_of(
    st.integers(1, 15).map(str), st.integers(1, 15).map(float), st.booleans(), st.none(),
    st.floats(allow_nan=False, allow_infinity=False), st.lists(st.integers(1, 15), max_size=2),
    st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)  # fmt: skip


@given(st.integers(0, 14), NOT_A_JSON_INTEGER)
def test_a_jsonl_step_that_is_not_a_json_integer_is_never_judged(run_cli, line, step):
    records = _clean_records()
    records[line] = (step, records[line][1])
    code, err = _gate(run_cli, records, jsonl=True)
    assert code == 2 and f":{line + 1}: step=" in err, err


BASELINE_LEVELS = {  # where in a baseline, and the keys allowed there
    (): cmp.BASELINE_KEYS,
    ("window",): cmp.WINDOW_KEYS,
    ("metrics", METRICS[0]): cmp.METRIC_KEYS,
    ("metrics", METRICS[0], "limit"): ("kind", *cmp.LIMIT_KEYS),
    ("guards", METRICS[0]): cmp.GUARD_KEYS,
}


def _good_baseline() -> dict:
    limits = {"kind": "relative", "tolerance": 0.5}
    return {
        "job": "j", "window": {"first_step": 5, "last_step": 14},
        "metrics": {m: {"value": GOOD_VALUE[m], "limit": dict(limits)} for m in METRICS},
        "guards": {METRICS[0]: {"step": 1, "min": 0.0}},
    }  # fmt: skip


def _compare_text(run_cli, text: str) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        _write_log(log, _clean_records(), jsonl=False)
        path.write_text(text)
        code, _, err = run_cli("ci", "compare", str(log), str(path))
    return code, err, str(path)


def test_the_good_baseline_of_these_properties_passes(run_cli):
    assert _compare_text(run_cli, json.dumps(_good_baseline()))[0] == 0


@given(st.sampled_from(sorted(BASELINE_LEVELS)), st.text(min_size=1, max_size=12), ANY_VALUE)
def test_an_unknown_key_at_any_level_of_a_baseline_is_refused(run_cli, level, key, value):
    assume(key not in BASELINE_LEVELS[level])
    data = _good_baseline()
    node = data
    for name in level:
        node = node[name]
    node[key] = value
    code, err, path = _compare_text(run_cli, json.dumps(data))
    assert code == 2 and path in err, err


def _dump_with_a_key_twice(value, target: int, counter: list[int], again) -> str:
    """``value`` as JSON, its ``target``-th object (depth first) with its first key written twice."""
    if isinstance(value, dict):
        index = counter[0]
        counter[0] += 1
        items = [f"{json.dumps(k)}: {_dump_with_a_key_twice(v, target, counter, again)}" for k, v in value.items()]
        if index == target and value:
            items.append(f"{json.dumps(next(iter(value)))}: {json.dumps(again)}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dump_with_a_key_twice(v, target, counter, again) for v in value) + "]"
    return json.dumps(value)


@given(st.integers(0, 8), ANY_VALUE)  # the good baseline holds 9 objects
def test_a_key_twice_in_any_object_of_a_baseline_is_refused(run_cli, target, again):
    text = _dump_with_a_key_twice(_good_baseline(), target, [0], again)
    code, err, path = _compare_text(run_cli, text)
    assert code == 2 and path in err and "twice" in err, err


@given(st.text(max_size=30), st.sampled_from(["--image", "--commit"]))
def test_update_writes_an_image_or_commit_only_as_one_line_of_printable_text(run_cli, value, option):
    with tempfile.TemporaryDirectory() as tmp:
        log, path = Path(tmp) / "t.log", Path(tmp) / "b.json"
        _write_log(log, _clean_records(), jsonl=False)
        _baseline(path)
        before = path.read_text()
        code, _, err = run_cli("ci", "compare", str(log), str(path), "--update", option, value)
        after = path.read_text()
    if code == 0:
        assert value and all(c.isascii() and c.isprintable() and not c.isspace() for c in value), value
        assert json.loads(after)[option.lstrip("-")] == value
    else:
        assert code == 2 and option in err and after == before, err


# --- doctor: npu-smi output ------------------------------------------------------------------------------


def _doctor_on(output):
    """platform, its finding, and the report's NPU section, for npu-smi answering ``output``."""
    from support.doctor_env import STACK, fake_run, make_probe

    from verl_npu import doctor
    from verl_npu.doctor import report as doctor_report

    probe = make_probe([Path("/nonexistent")])
    probe.run = fake_run(npu=output)
    plat = doctor.detect_platform(probe)
    findings = doctor.check_platform(probe, STACK, plat, plat.target if plat.target != "unknown" else "dev", None)
    probe.env = {doctor.EXPECT_NPUS_ENV: "8"}
    findings += doctor.check_expected_npus(probe, plat)
    writer = doctor_report._Writer()
    doctor_report._npus(writer, probe, plat, output)
    return plat, findings, "\n".join(writer.lines)


def _decoded(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")  # as verl_npu.processes decodes a tool's output


@given(st.one_of(st.binary(max_size=400).map(_decoded), st.text(max_size=400)))
def test_npu_smi_garbage_is_never_an_ascend_node_that_is_ok(output):
    plat, findings, section = _doctor_on(output)
    if plat.target in ("a2", "a3"):
        assert detect.read_npu_smi(output).chips, output  # a chip only from an NPU table that was read
    else:
        assert all(f.status == FAIL for f in findings if f.check.startswith("platform")) or plat.kind != "ascend"
    if "|" not in output:  # no table at all: nothing is healthy
        assert plat.target not in ("a2", "a3")
        assert not any(f.status == OK for f in findings)
    assert "NPU" in section


@given(st.data())
def test_npu_smi_table_with_garbage_spliced_in_reads_or_fails_cleanly(data):
    """Real captures (tests_npu/data/npu_smi/) with bytes cut out and junk spliced in."""
    from support.doctor_env import CAPTURES, npu_smi_capture

    table = npu_smi_capture(data.draw(st.sampled_from(sorted(CAPTURES))))
    at = data.draw(st.integers(0, len(table)))
    cut = data.draw(st.integers(0, 200))
    junk = _decoded(data.draw(st.binary(max_size=120)))
    output = table[:at] + junk + table[at + cut :]
    plat, findings, section = _doctor_on(output)
    platform = [f for f in findings if f.check == "platform"]
    assert len(platform) == 1
    if platform[0].status == OK and plat.kind == "ascend":
        assert plat.devices and plat.devices >= 1
        # the report's NPU count is the count doctor checked: one reading of the table
        assert f"{detect.npus_phrase(plat.devices, plat.cards)} listed by `npu-smi info`" in section


@given(st.one_of(st.none(), st.integers(-255, 255)), st.text(max_size=200), st.one_of(st.none(), st.floats(0.1, 99)))
def test_a_failing_npu_smi_is_always_a_failure(returncode, stderr, timeout):
    failure = detect.CommandFailed(("npu-smi", "info"), returncode, stderr, timeout)
    plat, findings, section = _doctor_on(failure)
    assert plat.kind == "ascend" and plat.target == "unknown" and plat.problem
    assert "npu-smi" in plat.problem
    assert all(f.status == FAIL for f in findings)
    assert "Not read: NPU count and health" in section


# --- the stack manifest ---------------------------------------------------------------------------------

MANIFEST_LINES = MANIFEST_PATH.read_text().splitlines()
ASSIGNMENTS = [i for i, line in enumerate(MANIFEST_LINES) if "=" in line and not line.lstrip().startswith("#")]
TOML_SCALAR = st.one_of(
    st.text(max_size=30).map(json.dumps),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "nan", "-inf", "1979-05-27", "07:32:00", '""', "'x'", '"' + "x" * 100000 + '"',
                     '"3.12"', '"UNVERIFIED"', '"https://example.com/x.git"', '"patches/x/../../etc.patch"',
                     "[" * 3000 + "]" * 3000]),
)  # fmt: skip
TOML_VALUE = st.recursive(
    TOML_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), inner, max_size=3).map(
            lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"
        ),
    ),
    max_leaves=6,
)


@st.composite
def manifests(draw):
    lines = list(MANIFEST_LINES)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "value", "value", "delete", "duplicate", "key", "line", "header"]))
        i = draw(st.sampled_from(ASSIGNMENTS))
        key, _, _ = lines[i].partition("=")
        if kind == "value":
            lines[i] = f"{key}= {draw(TOML_VALUE)}"
        elif kind == "delete":
            lines[i] = ""
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "key":
            lines[i] = f"{draw(st.from_regex(r'[a-z_]{1,20}', fullmatch=True))} ={lines[i].partition('=')[2]}"
        elif kind == "line":
            lines[i] = draw(st.text(max_size=60))
        else:
            headers = [j for j, line in enumerate(lines) if line.startswith("[")]
            j = draw(st.sampled_from(headers))
            name = draw(st.one_of(st.from_regex(r"[a-z0-9_-]{1,12}", fullmatch=True), st.just("x" * 5000),
                                  st.text(max_size=10).map(json.dumps)))  # fmt: skip
            table = lines[j].strip("[]").split(".")[0]
            lines[j] = f"[{table}.{name}]"
    return "\n".join(lines) + "\n"


def _load_everything(path: Path) -> None:
    stack = load_stack(path)
    for target in TARGETS:
        stack.constraints(target)
        list(install_plan(stack, target))
    json.dumps(stack.to_dict(), default=str)


@given(manifests())
def test_a_mutated_manifest_loads_or_raises_stack_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stack.toml"
        path.write_text(text, errors="surrogateescape")
        try:
            _load_everything(path)
        except StackError as exc:
            assert str(path) in str(exc) or "target" in str(exc), exc
            assert len(str(exc)) < 2000, len(str(exc))


@given(st.binary(max_size=300), st.integers(0, 20000))
def test_bytes_spliced_into_the_manifest_load_or_raise_stack_error(junk, position):
    data = MANIFEST_PATH.read_bytes()
    position %= len(data)
    assume(junk)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stack.toml"
        path.write_bytes(data[:position] + junk + data[position:])
        try:
            _load_everything(path)
        except StackError as exc:  # any other exception propagates and fails the property
            assert len(str(exc)) < 2000, len(str(exc))
