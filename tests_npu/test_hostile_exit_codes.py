"""Issue 29, class 5: exit codes that lie (docs/errors.md: 1 a check found a problem, 2 bad input, nothing judged).

`contracts verify --source mindspeed=/nonexistent` said "0 of N contracts hold" and exit 1, which an image build
reports as upstream drift; `python -m verl_npu.stack detect-target` said 2 (bad input) for a node whose npu-smi it
had read. install.sh's options and variables: tests_npu/stack/test_install_sh.py.
"""

from __future__ import annotations

import json

import pytest
from support.doctor_env import UNKNOWN_CAPTURE, install_npu_smi

from verl_npu.cli import main
from verl_npu.contracts import mindspeed
from verl_npu.stack import __main__ as stack_main

MINDSPEED_FILES = len({c.path for c in mindspeed.CONTRACTS})


def verify(*argv: str) -> int:
    return main(["contracts", "verify", *argv])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("mindspeed=/nonexistent", "--source 'mindspeed=/nonexistent': /nonexistent does not exist"),
        ("mindspeed=/dev/null", "--source 'mindspeed=/dev/null': /dev/null is not a directory"),
        ("mindspeed=", "--source 'mindspeed=': DIR is empty; give the mindspeed source tree"),
        ("MindSpeed=/tmp", "--source 'MindSpeed=/tmp': expected NAME=DIR with NAME one of mindspeed, vllm-ascend"),
        ("/tmp", "--source '/tmp': expected NAME=DIR"),
    ],
)
def test_a_source_that_is_not_a_source_tree_is_exit_2_before_verifying(source, message, capsys):
    assert verify("--component", "mindspeed", "--source", source) == 2
    captured = capsys.readouterr()
    assert f"verl-npu contracts verify: {message}" in captured.err
    assert "contracts hold" not in captured.out  # nothing was verified


def test_an_empty_source_directory_is_a_wrong_path_not_drift(tmp_path, capsys):
    assert verify("--source", f"mindspeed={tmp_path}") == 2
    err = capsys.readouterr().err
    assert f"none of the {MINDSPEED_FILES} files the mindspeed contracts read is in {tmp_path}" in err
    assert "give the directory that holds the mindspeed/ package" in err


def test_the_package_directory_itself_is_named_with_its_parent(tmp_path, capsys):
    package = tmp_path / "mindspeed"
    (package / "core").mkdir(parents=True)
    assert verify("--source", f"mindspeed={package}") == 2
    assert f"{package} looks like the mindspeed package itself: give its parent directory" in capsys.readouterr().err


def test_a_source_given_twice_or_for_a_component_not_checked_is_exit_2(tmp_path, capsys):
    """The second --source used to win silently; one for a component left out by --component was ignored."""
    tree = tmp_path / "ms"
    (tree / "mindspeed").mkdir(parents=True)
    assert verify("--source", f"mindspeed={tree}", "--source", f"mindspeed={tmp_path}") == 2
    assert f"--source mindspeed is given twice ({tree}, then '{tmp_path}'): give it once" in capsys.readouterr().err
    assert verify("--component", "vllm", "--source", f"mindspeed={tree}") == 2
    assert "mindspeed is not among the components checked (vllm)" in capsys.readouterr().err


def test_a_source_tree_that_changed_is_still_drift(tmp_path, capsys):
    """The files are there but say something else: exit 1, a report, as before."""
    tree = tmp_path / "ms"
    for contract in mindspeed.CONTRACTS[:1]:
        (tree / contract.path).parent.mkdir(parents=True, exist_ok=True)
        (tree / contract.path).write_text("def nothing():\n    pass\n")
    out = tmp_path / "rows.json"
    assert verify("--component", "mindspeed", "--source", f"mindspeed={tree}", "--json", str(out)) == 1
    assert f"0 of {len(mindspeed.CONTRACTS)} contracts hold" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert len(rows) == len(mindspeed.CONTRACTS) and {r["status"] for r in rows} <= {"missing", "drifted"}


@pytest.mark.parametrize("kind", ["missing directory", "directory"])
def test_contracts_json_that_cannot_be_written_is_exit_2_before_verifying(tmp_path, kind, capsys):
    target = tmp_path / "no" / "rows.json" if kind == "missing directory" else tmp_path
    assert verify("--component", "torch-npu", "--json", str(target)) == 2
    captured = capsys.readouterr()
    assert f"verl-npu contracts verify: --json {target}: " in captured.err
    assert "contracts hold" not in captured.out
    assert not (tmp_path / "no").exists()


# --- python -m verl_npu.stack detect-target ----------------------------------------------------------------------


def test_detect_target_on_a_node_it_has_no_stack_for_is_a_finding_not_bad_input(tmp_path, monkeypatch, capsys):
    bin_dir = install_npu_smi(tmp_path / "bin", UNKNOWN_CAPTURE)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("VERL_NPU_PROBE_TIMEOUT_S", raising=False)
    assert stack_main.main(["detect-target"]) == 1
    assert "npu-smi lists 310P3 chips: neither" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["\u0663\u0660", "0", "nan", "3_0"])
def test_detect_target_with_a_bad_probe_timeout_is_exit_2_naming_it(tmp_path, monkeypatch, capsys, value):
    bin_dir = install_npu_smi(tmp_path / "bin", UNKNOWN_CAPTURE)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("VERL_NPU_PROBE_TIMEOUT_S", value)
    assert stack_main.main(["detect-target"]) == 2
    assert f"VERL_NPU_PROBE_TIMEOUT_S={value!r}: expected a finite number" in capsys.readouterr().err
