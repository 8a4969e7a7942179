"""`verl-npu versions` (the manifest as a table and as JSON), and how every command reports a failure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl_npu.stack import load_stack


def verl_npu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_versions_json_is_the_manifest():
    done = verl_npu("versions", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    stack = load_stack()
    assert doc["python"] == stack.python
    assert doc["packages"]["verl"]["version"] == "0.9.1"
    assert doc["git"]["mindspeed"]["commit"] == stack.git["mindspeed"].commit
    assert doc["chips"]["a3"]["base_image"] == stack.chips["a3"].base_image


def test_versions_table_shows_every_component_with_full_commits():
    done = verl_npu("versions")
    assert done.returncode == 0, done.stderr
    flat = "".join(done.stdout.split())  # the table folds long cells over lines
    stack = load_stack()
    for name in [*stack.packages, *stack.git]:
        assert name in done.stdout
    for comp in stack.git.values():
        assert (comp.commit if comp.verified else "UNVERIFIED") in flat


def test_versions_for_one_target_hides_the_others():
    done = verl_npu("versions", "--target", "dev")
    assert done.returncode == 0
    assert "torch-npu" not in done.stdout and "mindspeed" not in done.stdout and "megatron-core" in done.stdout


def test_a_broken_manifest_is_reported_not_a_traceback(tmp_path):
    bad = tmp_path / "stack.toml"
    bad.write_text("schema = 1\n")
    done = verl_npu("--manifest", str(bad), "versions")
    assert done.returncode == 2
    assert "key 'chips' is missing" in done.stderr and "Traceback" not in done.stderr


def test_the_command_line_loads_a_commands_modules_only_when_it_runs():
    """Preflight's cold start waits on the CLI's imports: building the parser loads no command's machinery."""
    code = (
        "import sys; from verl_npu.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith(('verl_npu.doctor', 'verl_npu.contracts', "
        "'verl_npu.k8s.render', 'rich'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_contracts_verify_refuses_an_unknown_component_by_name():
    done = verl_npu("contracts", "verify", "--component", "mindspeed", "--component", "megatron")
    assert done.returncode == 2
    assert "--component megatron: expected one of mindspeed, vllm-ascend, torch-npu, vllm" in done.stderr


def _fail_with(monkeypatch, exc: BaseException):
    from verl_npu import cli

    def broken(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_versions", broken)
    return cli


def test_an_expected_failure_is_one_line_and_exit_2(monkeypatch, capsys):
    from verl_npu.inputs import InputError

    cli = _fail_with(monkeypatch, InputError("trainer.nnodes", -1, "an integer >= 1", source="launch.sh"))
    assert cli.main(["versions"]) == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err == "verl-npu versions: launch.sh: trainer.nnodes=-1: expected an integer >= 1\n"


def test_an_unreadable_file_is_exit_2_naming_it(monkeypatch, capsys):
    cli = _fail_with(monkeypatch, FileNotFoundError(2, "No such file or directory", "/nowhere/baseline.json"))
    assert cli.main(["versions"]) == 2
    assert "/nowhere/baseline.json" in capsys.readouterr().err


def test_a_bug_is_a_short_message_exit_3_and_the_traceback_only_with_debug(monkeypatch, capsys):
    cli = _fail_with(monkeypatch, KeyError("megatron"))
    assert cli.main(["versions"]) == cli.EXIT_INTERNAL == 3
    err = capsys.readouterr().err
    assert "internal error: KeyError: 'megatron'" in err and "--debug" in err and "Traceback" not in err
    with pytest.raises(KeyError, match="megatron"):  # --debug lets it through, wherever it is on the line
        cli.main(["versions", "--debug"])


def test_debug_is_accepted_before_the_command_too(monkeypatch):
    cli = _fail_with(monkeypatch, ZeroDivisionError("division by zero"))
    with pytest.raises(ZeroDivisionError):
        cli.main(["--debug", "versions"])


def test_debug_after_double_dash_is_the_scripts_argument(monkeypatch):
    from verl_npu import cli

    seen = {}

    def preflight(args):
        seen["args"] = list(args.args)
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "cmd_preflight", preflight)
    assert cli.main(["preflight", "run.sh", "--", "a=1", "--debug"]) == cli.EXIT_INTERNAL  # not re-raised
    assert seen["args"] == ["a=1", "--debug"]
