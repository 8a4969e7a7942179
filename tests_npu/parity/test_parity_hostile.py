"""`verl-npu parity` never passes on a run that lacks what it claims (issue 29): zero or inconsistent steps, a key
given twice, a step count in another script. The runs are the committed reference's own (no job is run here): the
reference's fp32 run compared with itself (``--against``, end to end) passes, and each edit below must not. In the
default mode (block by block) a run must have been replayed from the reference: the reference's own run was not, and
is refused by name."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from verl_npu.cli import main
from verl_npu.parity.cli import DEFAULT_REFERENCE


@pytest.fixture(scope="module")
def reference_text() -> str:
    return DEFAULT_REFERENCE.read_text()


@pytest.fixture
def fp32_run(reference_text) -> dict:
    """The reference's fp32 run as a `parity run` file holds it."""
    return json.loads(reference_text)["runs"]["fp32"]


def cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["parity", *argv])
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
    return code, err.getvalue()


def compare(tmp_path: Path, run: dict | str, *options: str, against: dict | None = None) -> tuple[int, str]:
    """``parity compare`` of ``run`` against ``against`` (end to end, the pair mode), or against the reference."""
    path = tmp_path / "run.json"
    path.write_text(run if isinstance(run, str) else json.dumps(run))
    if against is not None:
        (tmp_path / "against.json").write_text(json.dumps(against))
        options = ("--against", str(tmp_path / "against.json"), *options)
    return cli("compare", str(path), "--model", "dense", *options)


def _steps_cut(run: dict, steps: int) -> dict:
    run = json.loads(json.dumps(run))  # a copy: the run it is cut from stays whole
    for model in run["models"].values():
        model["train"]["losses"] = model["train"]["losses"][:steps]
        model["train"]["grad_norms"] = model["train"]["grad_norms"][:steps]
    return {**run, "steps": steps}


def test_the_reference_run_passes_against_itself(tmp_path, fp32_run):
    code, err = compare(tmp_path, fp32_run, against=fp32_run)
    assert code == 0 and "OK" in err, err


def test_a_run_not_replayed_from_the_reference_is_refused_in_the_default_mode(tmp_path, fp32_run):
    """The default mode judges each block fed the reference's inputs: a run made without --replay-from has none."""
    code, err = compare(tmp_path, fp32_run)
    assert code == 2 and "the run was not replayed" in err and "--replay-from" in err, err


@pytest.mark.parametrize(
    ("steps", "named"),
    [(0, "steps=0"), (-3, "steps=-3"), ("3", "steps='3'"), (3.0, "steps=3.0"), (True, "steps=True"), (None, "steps")],
)
def test_a_run_whose_steps_are_not_a_positive_json_integer_is_refused(tmp_path, fp32_run, steps, named):
    code, err = compare(tmp_path, {**fp32_run, "steps": steps}, against=fp32_run)
    assert code == 2 and named in err and "run.json" in err, err


def test_a_run_with_zero_steps_and_no_training_never_passes(tmp_path, fp32_run):
    code, err = compare(tmp_path, {**_steps_cut(fp32_run, 0)}, against=fp32_run)
    assert code == 2 and "steps=0" in err, err


def test_a_run_whose_steps_disagree_with_its_losses_is_refused(tmp_path, fp32_run):
    steps = fp32_run["steps"]
    code, err = compare(tmp_path, {**fp32_run, "steps": steps - 1}, against=fp32_run)
    assert code == 2 and f"{steps} losses" in err and f"steps={steps - 1}" in err, err


def test_a_run_with_fewer_steps_than_the_reference_fails(tmp_path, fp32_run):
    code, err = compare(tmp_path, _steps_cut(fp32_run, fp32_run["steps"] - 1), against=fp32_run)
    assert code == 1 and "FAIL" in err, err


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ('"steps": 2', '"steps": 2, "steps": 0', "'steps'"),
        ('"dtype": "fp32"', '"dtype": "fp32", "dtype": "bf16"', "'dtype'"),
        ('"models": {', '"models": {"dense": {}, ', "'dense'"),
    ],
)
def test_a_key_twice_in_a_run_is_refused(tmp_path, fp32_run, old, new, named):
    text = json.dumps(fp32_run)
    assert old in text
    code, err = compare(tmp_path, text.replace(old, new, 1), against=fp32_run)
    assert code == 2 and named in err and "twice" in err, err


def test_a_key_twice_in_the_reference_is_refused(tmp_path, fp32_run, reference_text):
    ref = tmp_path / "ref.json"
    ref.write_text(reference_text.replace('"format": 2', '"format": 2, "format": 1', 1))
    code, err = compare(tmp_path, fp32_run, "--reference", str(ref))
    assert code == 2 and "'format'" in err and "twice" in err, err


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("kind", "verl-npu parity reference", "runs.fp32: kind="), ("format", 1, "runs.fp32: format=1")],
)
def test_a_reference_run_of_another_kind_or_format_is_refused(tmp_path, fp32_run, reference_text, field, value,
                                                               named):  # fmt: skip
    data = json.loads(reference_text)
    data["runs"]["fp32"][field] = value
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(data))
    code, err = compare(tmp_path, fp32_run, "--reference", str(ref))
    assert code == 2 and named in err, err


@pytest.mark.parametrize("steps", ["0", "\u0661\u0666", "\uff13", "1_6", "0x3", "3.0", "", "101"])
def test_parity_run_steps_are_ascii_decimal_in_range_refused_before_any_work(tmp_path, steps):
    """argparse's type=int reads Arabic-Indic and full-width digits and '1_6'; every other option refuses them."""
    code, err = cli("run", "--steps", steps, "--out", str(tmp_path / "missing" / "run.json"))
    shown = steps if steps.isascii() and steps.isdigit() else repr(steps)  # a number in range, as it was read
    assert code == 2 and f"--steps={shown}: expected an integer from 1 to 100" in err, err
