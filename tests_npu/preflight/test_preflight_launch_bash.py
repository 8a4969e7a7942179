"""A launch read as bash runs it (issue 29, class 2), with bash itself as the oracle.

Each case edits a copy of the GLM-5.2 launch (examples/glm5_2), runs it with real ``bash`` where ``python3`` is a
function that records the trainer's arguments (so nothing is started), and checks preflight's reading against what
bash did: the trainer's words are bash's words, or preflight says why not with a FAIL naming the line. The
constructs: CRLF line endings, ``exit`` before the trainer, the trainer under a condition, brace expansion, and a
blank after a line-continuation backslash.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter_bash", reason="the launch reader parses bash with tree-sitter; not installed here")

from support.paths import REPO as REPO_ROOT

from verl_npu.preflight.launch import Launch, read_launch_script

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is the oracle here; not installed")

EXAMPLE = REPO_ROOT / "examples" / "glm5_2"
SCRIPT = "run_glm5_2_grpo_a3.sh"
TRAINER_START = '"$PYTHON" -m verl.trainer.main_ppo'
ENV = {"MODEL_PATH": "/models/GLM-5.2"}
# sourced by bash before the script (BASH_ENV), so the script's line numbers stay its own
RECORDER = 'python3() { shift 2; printf "%s\\0" "$@" > "$ARGS_OUT"; }\n'


def glm(tmp_path: Path, edit=None, data: bytes | None = None) -> Path:
    """A copy of the GLM-5.2 example with its launch script edited (``edit(text) -> text``) or replaced."""
    folder = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, folder, dirs_exist_ok=True)
    script = folder / SCRIPT
    if data is None:
        text = script.read_text()
        data = (edit(text) if edit else text).encode()
    script.write_bytes(data)
    return script


def before_trainer(lines: str):
    return lambda text: text.replace(TRAINER_START, lines + "\n" + TRAINER_START, 1)


def line_of(script: Path, needle: str) -> int:
    return next(i for i, line in enumerate(script.read_bytes().split(b"\n"), 1) if needle.encode() in line)


def bash_words(script: Path, env: dict[str, str] = ENV) -> list[str] | None:
    """The trainer's arguments when bash runs ``script`` (after ``-m verl.trainer.main_ppo``), None if never run."""
    prelude, out = script.parent / "recorder.sh", script.parent / "args.bin"
    prelude.write_text(RECORDER)
    out.unlink(missing_ok=True)
    run_env = {"PATH": "/usr/bin:/bin", "BASH_ENV": str(prelude), "ARGS_OUT": str(out), **env}
    subprocess.run(["bash", str(script)], env=run_env, capture_output=True, timeout=30, cwd=script.parent)
    return out.read_bytes().decode().split("\0")[:-1] if out.exists() else None


def read(script: Path, env: dict[str, str] = ENV) -> Launch:
    return read_launch_script(script, [], env)


def words(launch: Launch) -> list[str]:
    return [f"--config-name={launch.config_name}", *launch.overrides] if launch.config_name else list(launch.overrides)


def errors(launch: Launch, code: str | None = None) -> list:
    return [f for f in launch.findings if f.severity == "error" and code in (None, f.code)]


def preflight_cli(*argv: str) -> tuple[int, str]:
    from verl_npu.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["preflight", *argv])
    return code, out.getvalue()


def test_the_unedited_example_is_read_as_bash_runs_it(tmp_path):
    script = glm(tmp_path)
    launch = read(script)
    assert words(launch) == bash_words(script)
    assert errors(launch) == []


# --- CRLF ----------------------------------------------------------------------------------------------------------


def test_crlf_script_fails_naming_its_first_line_and_bash_never_runs_the_trainer(tmp_path):
    script = glm(tmp_path, data=(EXAMPLE / SCRIPT).read_bytes().replace(b"\n", b"\r\n"))
    assert bash_words(script) is None  # `set -o pipefail\r` is an invalid option: set -e stops the script
    (crlf,) = errors(read(script), "crlf")
    assert crlf.line == 1 and "dos2unix" in crlf.message and "sed -i 's/\\r$//'" in crlf.message


def test_crlf_without_set_e_cuts_the_trainer_arguments_in_bash(tmp_path):
    script = tmp_path / "run.sh"
    script.write_bytes(b"python3 -m verl.trainer.main_ppo a=1 \\\r\n  b=2\r\n")
    launch = read(script)
    assert bash_words(script) == ["a=1", "\r"]  # `\` + CR is no continuation: the command ends there
    assert words(launch) == ["a=1", "b=2"] and [f.line for f in errors(launch, "crlf")] == [1]


def test_crlf_in_a_sourced_env_file_is_named_with_the_file(tmp_path):
    script = glm(tmp_path)
    env_file = script.parent / "glm5_2.env"
    env_file.write_bytes(env_file.read_bytes().replace(b"MODEL_PATH=", b"\r\nX=1\r\nMODEL_PATH="))
    (crlf,) = errors(read(script, {}), "crlf")
    assert crlf.message.startswith("glm5_2.env: ") and "dos2unix" in crlf.message


# --- exit, return, exec before the trainer ---------------------------------------------------------------------------

ENDS_THE_SCRIPT = [
    "exit 0",
    "exit",
    "exit 1",
    "return",  # at the top level bash refuses it, and set -e stops the script on that
    "exec true",
    "[ 1 = 1 ] && exit 0",
    "if true; then exit 0; fi",
    "stop() { exit 0; }; stop",
    'case "$NNODES" in 32) exit 0;; esac',
    "true || false || exit 3; false || exit 4",
    "echo x | exit 1",  # set -e: the pipeline fails
    "( exit 2 )",
]
DOES_NOT = [
    "( exit 0 )",
    "true || exit 1",
    "true | exit 0",  # (echo would race exit for SIGPIPE, which pipefail turns into a failure)
    "(exit 1) || true",
    "[ 1 = 0 ] && exit 0",
    "if false; then exit 0; fi",
    "exec >/dev/null",
    'if [ -z "$MODEL_PATH" ]; then exit 1; fi',
    "command -v ls >/dev/null || exit 1",
    "f() { return 0; echo unreached; }; f",
]


@pytest.mark.parametrize("line", ENDS_THE_SCRIPT)
def test_an_exit_before_the_trainer_is_a_fail_naming_its_line(tmp_path, line):
    script = glm(tmp_path, before_trainer(line))
    assert bash_words(script) is None
    launch = read(script)
    (found,) = errors(launch, "not-reached")
    assert found.line == line_of(script, line.split(";")[-1].strip()) or found.line == line_of(script, line)
    assert f"line {found.line}" in found.message and launch.module is None


@pytest.mark.parametrize("line", DOES_NOT)
def test_an_exit_bash_does_not_take_leaves_the_launch_as_it_was(tmp_path, line):
    script = glm(tmp_path, before_trainer(line))
    ran = bash_words(script)
    launch = read(script)
    assert ran is not None and words(launch) == ran
    assert errors(launch) == []


def test_an_exit_under_a_condition_preflight_cannot_evaluate_is_a_fail(tmp_path):
    script = glm(tmp_path, before_trainer("[ -f /etc/verl-npu-skip ] && exit 0"))
    (found,) = errors(read(script), "conditional")
    at = line_of(script, "verl-npu-skip")
    assert found.line == at and f"line {at}: `exit 0` ends the script when `[ -f /etc/verl-npu-skip ]`" in found.message
    assert "tests the file system" in found.message and f"the trainer (line {at + 1}) never runs" in found.message


def test_a_guard_on_a_variable_is_evaluated_when_it_is_given(tmp_path):
    script = glm(tmp_path, before_trainer('[ -n "$RUN_ID" ] || { echo "set RUN_ID"; exit 1; }'))
    assert bash_words(script) is None and bash_words(script, {**ENV, "RUN_ID": "7"}) is not None
    launch = read(script)  # not given: preflight does not guess it, and the guard fails the job if it stops it
    (guard,) = [f for f in launch.findings if f.code == "guard"]
    assert guard.severity == "warning" and errors(launch) == []
    assert "$RUN_ID is not set here: give its value with --env RUN_ID=VALUE" in guard.message
    assert "the job fails there and the trainer" in guard.message
    given = read(script, {**ENV, "RUN_ID": "7"})
    assert errors(given) == [] and not [f for f in given.findings if f.code == "guard"]


@pytest.mark.parametrize(
    ("guard", "fails"),
    [("[ -f /etc/verl-npu-x ] || exit 2", True), ("[ -f /etc/verl-npu-x ] || exit 256", False),
     ("[ -f /etc/verl-npu-x ] || exit", False), ("die() { echo no; exit 1; }; [ -f /etc/verl-npu-x ] || die", True),
     ("die() { echo no; exit; }; [ -f /etc/verl-npu-x ] || die", False)],
)  # fmt: skip
def test_only_an_exit_that_fails_the_job_is_a_guard_under_a_condition_preflight_cannot_evaluate(tmp_path, guard,
                                                                                                 fails):  # fmt: skip
    # exit 256 is status 0 and a bare exit is the last command's (echo's) status: the job would end as a success
    launch = read(glm(tmp_path, before_trainer(guard)))
    assert [f.code for f in launch.findings if f.code in ("guard", "conditional")] == [
        "guard" if fails else "conditional"
    ]


# --- the trainer under a condition ---------------------------------------------------------------------------------

NEVER_RUN = ["if false; then", "if [ 1 = 0 ]; then", 'if [[ -n "" ]]; then', "if (( 2 < 1 )); then",
             "if [ a = b ]; then :; else false; fi; if ! true; then", 'while [ "$NNODES" = 0 ]; do']  # fmt: skip
RUN = ["if true; then", "if [ 1 = 1 ]; then", "if [[ $NNODES == 3* ]]; then", "if (( 2 > 1 )); then"]


def wrap(opening: str):
    closing = "done" if opening.startswith("while") else "fi"

    def edit(text: str) -> str:
        body = text.replace(TRAINER_START, opening + "\n" + TRAINER_START, 1)
        return body.replace('    "$@"\n', '    "$@"\n' + (f"break\n{closing}\n" if closing == "done" else "fi\n"))

    return edit


@pytest.mark.parametrize("opening", NEVER_RUN)
def test_a_trainer_under_a_false_condition_never_runs(tmp_path, opening):
    script = glm(tmp_path, wrap(opening))
    assert bash_words(script) is None
    launch = read(script)
    (found,) = errors(launch, "not-reached")
    assert found.line == line_of(script, TRAINER_START) and launch.module is None
    assert "never runs" in found.message


@pytest.mark.parametrize("opening", RUN)
def test_a_trainer_under_a_true_condition_is_read_with_bashs_words(tmp_path, opening):
    script = glm(tmp_path, wrap(opening))
    launch = read(script)
    assert words(launch) == bash_words(script)
    assert errors(launch) == []


@pytest.mark.parametrize("opening", ["if [ -f /etc/verl-npu-x ]; then", "if [[ $(hostname) == head* ]]; then",
                                     'if [ "$ROLE" = head ]; then', "if ! ray status; then"])  # fmt: skip
def test_a_trainer_under_a_condition_preflight_cannot_evaluate_is_a_fail_naming_its_line(tmp_path, opening):
    script = glm(tmp_path, wrap(opening))
    (found,) = errors(read(script), "conditional")
    assert found.line == line_of(script, TRAINER_START) - 1
    assert f"whether the trainer (line {found.line + 1}) runs depends on" in found.message


def test_a_trainer_after_a_command_it_needs_to_succeed_runs(tmp_path):
    script = glm(tmp_path, lambda t: t.replace(TRAINER_START, "cd /tmp && " + TRAINER_START, 1))
    launch = read(script)
    assert words(launch) == bash_words(script) and errors(launch) == []


# --- brace expansion -------------------------------------------------------------------------------------------------

BRACES = ["x={1,2}", "x{,.y}=1", "+k.{a,b}={1..3}", "a{b,c{d,e}}f=1", "{a}b={c,d}", "{}", "k=[{a,b}]", "x={5..1..2}",
          "n={08..11}", "c={a..e}", "q='{1,2}'", 'r="{1,2}"', "s=\\{1,2\\}", "t={1,2", "u=${NNODES}{1,2}", "v={x}",
          'w={"a b",c}', "z={1...3}"]  # fmt: skip


def test_brace_expansion_gives_bashs_words(tmp_path):
    body = " ".join(BRACES)
    script = glm(tmp_path, lambda t: t.replace('    "$@"\n', f'    {body} \\\n    "$@"\n'))
    launch = read(script)
    assert words(launch) == bash_words(script)
    assert {f.code for f in errors(launch)} == {"brace-expansion"}  # x={1,2} sets x twice; no other finding


def test_a_key_set_twice_by_brace_expansion_is_a_fail_naming_the_line(tmp_path):
    script = glm(tmp_path, lambda t: t.replace("data.train_batch_size=64", "data.train_batch_size={64,128}"))
    ran = bash_words(script)
    launch = read(script)
    assert words(launch) == ran and "data.train_batch_size=64" in ran and "data.train_batch_size=128" in ran
    (found,) = errors(launch, "brace-expansion")
    assert found.line == line_of(script, "{64,128}") and "data.train_batch_size more than once" in found.message


# --- a blank after a line-continuation backslash ------------------------------------------------------------------


@pytest.mark.parametrize("blank", [" ", "\t", "  \t"])
def test_a_blank_after_a_continuation_is_one_fail_naming_the_line(tmp_path, blank):
    script = glm(
        tmp_path, lambda t: t.replace("data.train_batch_size=64 \\\n", f"data.train_batch_size=64 \\{blank}\n")
    )
    ran = bash_words(script)
    launch = read(script)
    at = line_of(script, "data.train_batch_size=64")
    # bash: the trainer got the arguments up to that line (and the escaped blank); the rest became a command
    assert ran is not None and ran[-1] == blank[0] and ran[:-1] == words(launch)[: len(ran) - 1]
    assert len(ran) - 1 < len(words(launch))  # preflight read the lines as the author meant them
    (found,) = errors(launch)
    assert (found.code, found.line) == ("line-continuation", at) and f"line {at}:" in found.message


def test_a_backslash_blank_in_quotes_or_comments_is_no_continuation(tmp_path):
    edit = before_trainer("echo 'a \\ \nb'\n# a comment \\ \nNOTE=\"x \\ \ny\"")
    script = glm(tmp_path, edit)
    launch = read(script)
    assert words(launch) == bash_words(script) and errors(launch) == []


# --- the CLI: exit 1, and the line in the report ---------------------------------------------------------------------


CLI_CASES = {  # each read as meant gives the example's own overrides: preflight's cache answers after the first
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "not-reached": before_trainer("exit 0"),
    "conditional": wrap("if [ -f /etc/verl-npu-x ]; then"),
    "line-continuation": lambda t: t.replace("data.train_batch_size=64 \\\n", "data.train_batch_size=64 \\ \n"),
    "brace-expansion": lambda t: t.replace("trainer.save_freq=20", "trainer.save_freq={20,40}"),
}


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")  # one folder: the model config beside the script is the same file


@pytest.mark.parametrize("code", CLI_CASES)
def test_cli_exits_1_naming_the_line(cli_folder, code):
    script = glm(cli_folder, CLI_CASES[code])
    status, out = preflight_cli(str(script), "--env", "MODEL_PATH=/models/GLM-5.2", "--json", "-")
    assert status == 1, out
    report = json.loads(out[out.index("{") :])
    (failed,) = [c for c in report["checks"] if c["status"] == "fail" and c["check"] == f"launch.{code}"]
    assert "line " in failed["detail"]
    assert "NoneType" not in out
