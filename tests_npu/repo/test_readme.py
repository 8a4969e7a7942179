"""README.md stays true: current support matrix, and .ci/run runs exactly its test command."""

from __future__ import annotations

import re
import subprocess
import sys

from support.paths import REPO

from verl_npu.stack import load_stack
from verl_npu.stack.matrix import render_markdown, replace_in

README = (REPO / "README.md").read_text()


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def test_support_matrix_is_generated_from_the_current_manifest():
    stack = load_stack()
    assert render_markdown(stack) in README, "README support matrix is stale: run `verl-npu versions --markdown`"
    assert replace_in(README, stack) == README


def test_support_matrix_changes_when_a_pin_changes(tmp_path):
    manifest = tmp_path / "stack.toml"
    manifest.write_text(
        (REPO / "verl_npu/stack/stack.toml").read_text().replace('version = "2.10.0.post4"', 'version = "2.10.0.post7"')
    )
    assert render_markdown(load_stack(manifest)) not in README


def test_readme_has_the_two_commands_and_ci_runs_the_second():
    commands = _commands()
    assert len(commands) >= 2
    main_job, tests = commands[0], commands[1]
    assert main_job == "bash install.sh --dev && .venv/bin/verl-npu preflight examples/glm5_2/run_glm5_2_grpo_a3.sh"
    assert tests.startswith("bash install.sh --dev && ")
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert tests in ci_lines, f".ci/run must run README's test command verbatim: {tests!r}"


def test_versions_markdown_cli_prints_the_same_matrix():
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "versions", "--markdown"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == render_markdown(load_stack())
