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
    from verl_npu.preflight.config_check import compose_config

    launch = launch_from_overrides(overrides)
    config, checks = compose_config(launch.config_name, launch.overrides)
    assert checks and all(c.detail for c in checks)
    if config is None:
        assert any(c.status == FAIL for c in checks), checks
    elif not any(c.status == FAIL for c in checks):
        assert any(c.check == "config.compose" and c.status == OK for c in checks)
