"""`verl-npu versions`: the manifest as a table and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

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
