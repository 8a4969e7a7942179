"""Hostile launch scripts and override lists (issue 18): the launch reader and the override parser.

Properties:
- the launch reader, on scripts built from bash's constructs (assignments, arithmetic, expansions, loops, functions,
  ``source``, quotes) and on arbitrary bytes: it returns a Launch or raises LaunchError, within a time bound, and
  every finding is well-formed;
- arithmetic: the reader's value is bash's own (run through ``bash``), and it reports an ``arith-error`` exactly
  where bash fails on the expansion (and abandons the line, as bash does);
- overrides: Hydra composition of arbitrary override words never raises; a launch that does not compose always
  carries a FAIL check, and one that composes has no FAIL for a word it silently dropped.
"""

from __future__ import annotations

import shutil
import string
import subprocess
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tree_sitter_bash", reason="the launch reader parses bash with tree-sitter; not installed here")

from verl_npu.checks import FAIL, OK
from verl_npu.preflight.launch import LaunchError, launch_from_overrides, read_launch_script

TRAINER = "python3 -m verl.trainer.main_ppo"
SEVERITIES = {"error", "warning"}
BOUND_S = 10.0  # one script, on a slow 2-core CI machine

NAMES = st.sampled_from(["A", "B", "N", "TP", "ARR", "X_1", "HOME", "RANDOM", "1", "@", "#", "*"])
LITERALS = st.sampled_from(["0", "1", "-1", "7", "9223372036854775807", "0x10", "08", "2#11", "64#@", "1e9", "", "x"])


@st.composite
def _word(draw) -> str:
    name = draw(NAMES)
    return draw(
        st.sampled_from(
            [
                f"${name}",
                f"${{{name}}}",
                f"${{{name}:-{draw(LITERALS)}}}",
                f"${{{name}:?missing}}",
                f"${{#{name}}}",
                f"${{{name}//a/bb}}",
                f"${{{name}:1:-1}}",
                f"${{{name}[-2]}}",
                f'"${{{name}[@]}}"',
                f"$(( {name} {draw(st.sampled_from(['+', '*', '**', '/', '%', '<<', '?1:']))} {draw(LITERALS)} ))",
                f"$(cat {name})",
                f"'{draw(LITERALS)}'",
                f"k.{name}={draw(LITERALS)}",
                draw(st.text(string.printable, max_size=12)),
            ]
        )
    )


@st.composite
def _statement(draw) -> str:
    name, word = draw(NAMES.filter(str.isidentifier)), draw(_word())
    return draw(
        st.sampled_from(
            [
                f"{name}={word}",
                f"{name}+=({word} {word})",
                f"export {name}={word}",
                f"(( {name} = {draw(LITERALS)} {draw(st.sampled_from(['+', '**', '/', '>>']))} {draw(LITERALS)} ))",
                f"let {name}++",
                f"for i in {word} 2; do {name}=$i; done",
                f"if [[ -n {word} ]]; then {name}={word}; fi",
                f"f() {{ {name}={word}; f; }}; f",
                f"source {word}",
                "source /dev/stdin",
                f"shift {draw(LITERALS)}",
                "set -u",
                f'{TRAINER} a={word} {word} "$@"',
                f'{TRAINER} --config-path {word} b=1 | tee log "$@"',
            ]
        )
    )


def _read(tmp_path, data: bytes, args=()):
    script = tmp_path / "run.sh"
    script.write_bytes(data)
    start = time.perf_counter()
    try:
        launch = read_launch_script(script, args, {"A": "3", "ARR": "1 2"})
    except LaunchError as exc:
        assert str(exc)
        return None
    assert time.perf_counter() - start < BOUND_S
    for finding in launch.findings:
        assert finding.severity in SEVERITIES and finding.code and finding.message
        assert finding.line is None or finding.line >= 1
    assert all(isinstance(o, str) for o in launch.overrides)
    return launch


@given(statements=st.lists(_statement(), max_size=12), args=st.lists(st.text(max_size=8), max_size=3))
def test_scripts_of_bash_constructs_read_or_fail_cleanly_and_in_bounded_time(tmp_path_factory, statements, args):
    _read(tmp_path_factory.mktemp("launch"), ("\n".join(statements) + "\n").encode(), args)


@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_read_or_fail_cleanly(tmp_path_factory, data):
    _read(tmp_path_factory.mktemp("launch"), data)


_INTS = st.sampled_from(
    ["0", "1", "2", "3", "7", "-5", "63", "64", "100", "9223372036854775807", "0x7f", "017", "3#21"]
)
_OPS = st.sampled_from(["+", "-", "*", "/", "%", "**", "<<", ">>", "&", "|", "^", "<", ">=", "==", "&&", "||", ","])


@st.composite
def _expression(draw, depth: int = 0) -> str:
    if depth > 3 or draw(st.booleans()):
        atom = draw(st.one_of(_INTS, st.sampled_from(["A", "B", "U"])))
        return draw(st.sampled_from(["", "-", "!", "~"])) + atom
    left, right = draw(_expression(depth + 1)), draw(_expression(depth + 1))
    form = draw(st.sampled_from(["{} {} {}", "({} {} {})", "{} {} ({})"]))
    op = draw(_OPS)
    if op == "," and (depth or form != "{} {} {}"):
        op = "+"  # tree-sitter-bash misparses a comma inside parentheses ("$(( (1, 2) ))"); at the top it is fine
    return form.format(left, op, right)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@given(expression=_expression())
def test_arithmetic_agrees_with_bash(tmp_path_factory, expression):
    tmp_path = tmp_path_factory.mktemp("arith")
    body = f'A=6\nB=A+1\nX=none\nX=$(( {expression} ))\necho "$X"\n{TRAINER} x=$X\n'
    bash = subprocess.run(["bash", "-c", body.replace(TRAINER, ": ")], capture_output=True, text=True, timeout=10)
    launch = _read(tmp_path, body.encode())
    assert launch is not None
    # bash abandons the assignment's line on an error (X stays "none") and says so on stderr
    assert launch.overrides == (f"x={bash.stdout.strip()}",), (expression, bash.stderr)
    errors = [f for f in launch.findings if f.code == "arith-error"]
    assert bool(errors) == bool(bash.stderr.strip()), (expression, errors, bash.stderr)


_KEYS = st.sampled_from(
    ["trainer.nnodes", "data.train_batch_size", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
     "trainer.logger", "nope.key", "trainer", "actor_rollout_ref.rollout.n", "algorithm"]
)  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(["1", "-2", "0", "2.5", "null", "[1,2]", "{a:1}", "'x'", "${oc.env:HOME}", "${nope}", "", "a b"]),
    st.text(string.printable, max_size=10),
)


@st.composite
def _override(draw) -> str:
    prefix = draw(st.sampled_from(["", "", "+", "++", "~"]))
    key = draw(_KEYS)
    if prefix == "~" and draw(st.booleans()):
        return f"~{key}"
    return f"{prefix}{key}={draw(_VALUES)}" if draw(st.integers(0, 9)) else draw(st.text(string.printable, max_size=8))


@given(overrides=st.lists(_override(), max_size=3))
def test_override_lists_compose_or_fail_with_a_named_check(overrides):
    from verl_npu.preflight.compose import compose_config

    launch = launch_from_overrides(overrides)
    config, checks = compose_config(launch.config_name, launch.overrides)
    assert checks and all(c.detail for c in checks)
    if config is None:
        assert any(c.status == FAIL for c in checks), checks
    elif not any(c.status == FAIL for c in checks):
        assert any(c.check == "config.compose" and c.status == OK for c in checks)


# --- a launch read as bash runs it (issue 29, class 2) ---------------------------------------------------------------
# The invariant, with bash as the oracle: the trainer's words preflight reads are the words bash passes, or
# preflight's reading carries an error (a FAIL: the verdict is not GO). bash runs each script with `python3` a
# function (from BASH_ENV, so line numbers stay the script's) that records its arguments and starts nothing.

_RECORDER = 'python3() { shift 2; printf "%s\\0" "$@" > "$ARGS_OUT"; }\n'
_ENV = {"A": "3"}


def _bash_words(tmp_path, data: bytes) -> list[str] | None:
    script, prelude, out = tmp_path / "run.sh", tmp_path / "recorder.sh", tmp_path / "args.bin"
    script.write_bytes(data)
    prelude.write_text(_RECORDER)
    out.unlink(missing_ok=True)
    env = {"PATH": "/usr/bin:/bin", "BASH_ENV": str(prelude), "ARGS_OUT": str(out), **_ENV}
    subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=10, cwd=tmp_path)
    return out.read_bytes().decode(errors="surrogateescape").split("\0")[:-1] if out.exists() else None


def _as_bash_or_not_go(tmp_path, data: bytes, exempt: tuple[str, ...] = ()):
    """The launch preflight reads, after checking it against bash; ``exempt``: error codes that keep bash's words."""
    ran = _bash_words(tmp_path, data)
    launch = read_launch_script(tmp_path / "run.sh", [], _ENV)
    failed = [f for f in launch.findings if f.severity == "error" and f.code not in exempt]
    if not failed:
        assert ran is not None, ("bash never runs the trainer, but preflight reads no error", data, launch.findings)
        assert list(launch.overrides) == ran, (data, launch.findings)
    return launch, ran


_bash_only = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is the oracle; not installed")
_ARGS = ["a=$A \\", '  "b=x y" \\', "  c.d=${A}0 \\", "  e=1"]


@_bash_only
@given(crs=st.lists(st.booleans(), min_size=6, max_size=6), pipefail=st.booleans())
def test_crlf_anywhere_is_a_fail_or_bashs_reading(tmp_path_factory, crs, pipefail):
    lines = ["set -euo pipefail" if pipefail else "set -u", f"{TRAINER} \\", *_ARGS]
    data = "".join(line + ("\r\n" if cr else "\n") for line, cr in zip(lines, crs, strict=True)).encode()
    launch, _ = _as_bash_or_not_go(tmp_path_factory.mktemp("crlf"), data)
    crlf = [f.line for f in launch.findings if f.code == "crlf"]
    assert crlf == ([crs.index(True) + 1] if any(crs) else [])


_BRACE_ATOMS = st.sampled_from(["a", "b", "1", "07", "x.y", "", "'q r'", '"s,t"', "${A}", "\\,", "-", "k=v"])


@st.composite
def _brace_word(draw, depth: int = 0) -> str:
    if depth > 2 or draw(st.integers(0, 2)) == 0:
        return draw(_BRACE_ATOMS)
    form = draw(st.integers(0, 5))
    if form == 0:
        items = draw(st.lists(_brace_word(depth + 1), min_size=2, max_size=3))
        return "{" + ",".join(items) + "}"
    if form == 1:
        a, b = draw(st.integers(-3, 12)), draw(st.integers(-3, 12))
        step = draw(st.sampled_from(["", "..2", "..-3", "..0"]))
        return f"{{{draw(st.sampled_from(['', '0']))}{a}..{b}{step}}}"
    if form == 2:
        return "{" + draw(st.sampled_from(["a..e", "e..a", "A..C", "a..3", "1...3", "x"])) + "}"
    if form == 3:
        return draw(st.sampled_from(["{", "}", "{}", "{,}"]))
    return draw(_brace_word(depth + 1)) + draw(_brace_word(depth + 1))


@_bash_only
@given(words=st.lists(_brace_word(), min_size=1, max_size=3))
def test_brace_expansion_gives_bashs_words(tmp_path_factory, words):
    data = f"{TRAINER} {' '.join(f'k{i}={w}' for i, w in enumerate(words))}\n".encode()
    _as_bash_or_not_go(tmp_path_factory.mktemp("braces"), data, exempt=("brace-expansion",))


_LEAVE = st.sampled_from(
    ["exit 0", "exit 3", "( exit 1 )", "true || exit 1", "false && exit 2", '[ "$A" = 3 ] && exit 0',
     '[ "$B" = 3 ] || exit 0', "if [ 1 -lt 2 ]; then exit 0; fi", "if [[ $A == 4* ]]; then exit 1; fi",
     "f() { return 0; exit 1; }; f", "echo | exit 0", "echo | exit 4", "return", "exec true", "exec >/dev/null",
     "g() { exit 5; }", "case $A in 3) exit 0;; esac", "case $A in 4) exit 0;; esac", ": || exit 1"]
)  # fmt: skip


@_bash_only
@given(before=st.lists(_LEAVE, max_size=3), errexit=st.booleans())
def test_an_exit_before_the_trainer_is_bashs_or_a_fail(tmp_path_factory, before, errexit):
    lines = ["set -e" if errexit else "true", *before, f"{TRAINER} a=$A"]
    _as_bash_or_not_go(tmp_path_factory.mktemp("exit"), ("\n".join(lines) + "\n").encode())


_OPERANDS = st.sampled_from(["1", "2", "a", "$A", '"$A"', '""', '"$B"', "x*", "-n"])


@st.composite
def _condition(draw, depth: int = 0) -> str:
    form = draw(st.integers(0, 7 if depth < 2 else 4))
    left, right = draw(_OPERANDS), draw(_OPERANDS)
    if form == 0:
        return draw(st.sampled_from(["true", "false", ":", "[ -f /nonexistent/x ]", "(( A > 2 ))", "(( A < 2 ))"]))
    if form == 1:
        return f"[ {left} {draw(st.sampled_from(['=', '!=', '-eq', '-lt', '-gt']))} {right} ]"
    if form == 2:
        return f"[[ {left} {draw(st.sampled_from(['==', '!=', '-ge', '<']))} {right} ]]"
    if form == 3:
        return f"[ {draw(st.sampled_from(['-n', '-z', '!']))} {left} ]"
    if form == 4:
        return f"[[ {draw(st.sampled_from(['-n', '-z', '-v']))} {left.strip('$')} ]]"
    if form == 5:
        return f"! {draw(_condition(depth + 1))}"
    return f"{draw(_condition(depth + 1))} {draw(st.sampled_from(['&&', '||']))} {draw(_condition(depth + 1))}"


@_bash_only
@given(condition=_condition(), form=st.integers(0, 5))
def test_a_trainer_under_a_condition_is_bashs_or_a_fail(tmp_path_factory, condition, form):
    trainer = f"{TRAINER} a=$A"
    body = [
        f"if {condition}; then\n  {trainer}\nfi",
        f"if {condition}; then :; else\n  {trainer}\nfi",
        f"{condition} && {trainer}",
        f"{condition} || {trainer}",
        f"while {condition}; do\n  {trainer}\n  break\ndone",
        f"if {condition}; then exit 0; fi\n{trainer}",
    ][form]
    _as_bash_or_not_go(tmp_path_factory.mktemp("cond"), f"set -u\n{body}\n".encode())


@_bash_only
@given(blanks=st.lists(st.sampled_from(["", "", " ", "\t", "  ", " \t"]), min_size=4, max_size=4))
def test_a_blank_after_a_continuation_is_a_fail_naming_its_line(tmp_path_factory, blanks):
    lines = [f"{TRAINER} \\", *_ARGS[:3]]
    data = "".join(line + blank + "\n" for line, blank in zip(lines, blanks, strict=True)).encode() + b"  e=1\n"
    launch, _ = _as_bash_or_not_go(tmp_path_factory.mktemp("blank"), data)
    found = [f.line for f in launch.findings if f.code == "line-continuation"]
    assert found == [i + 1 for i, blank in enumerate(blanks) if blank]
    assert list(launch.overrides) == ["a=3", "b=x y", "c.d=30", "e=1"]  # read as the author meant it
