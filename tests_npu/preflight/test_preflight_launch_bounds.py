"""The launch reader on hostile scripts (issue 18): bash's own answers where bash answers at once, a warning
("could not evaluate ...") where evaluating would need unbounded work, and never a hang or a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter_bash", reason="the launch reader parses bash with tree-sitter; not installed here")

from verl_npu.preflight import shell
from verl_npu.preflight.launch import Launch, LaunchError, launch_from_overrides, read_launch_script

TRAINER = "python3 -m verl.trainer.main_ppo"


def read(tmp_path: Path, body: str, args=(), env=None) -> Launch:
    script = tmp_path / "run.sh"
    script.write_text(textwrap.dedent(body).lstrip("\n"))
    return read_launch_script(script, args, env)


def findings(launch: Launch, code: str) -> list[shell.Finding]:
    return [f for f in launch.findings if f.code == code]


def within(seconds: float, work):
    """``work()``'s result, or a test failure if it has not returned after ``seconds`` (a hang)."""
    result: list = []

    def target() -> None:
        try:
            result.append((True, work()))
        except BaseException as exc:  # raised again in the test's thread
            result.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    ok, value = result[0]
    if not ok:
        raise value
    return value


# --- arithmetic: bash's 64-bit answers, at once -------------------------------------------------------------------
ARITHMETIC = [
    "$(( 10 ** (10 ** 10) ))",  # bash wraps at 64 bits and answers at once
    "$(( 2 ** 63 ))",
    "$(( 2 ** 3 ** 2 ))",  # right-associative
    "$(( -2 ** 2 ))",
    "$(( 07 + 0x10 + 2#101 + 36#z ))",
    "$(( 1 << 70 ))",
    "$(( -9223372036854775807 - 1 ))",
    "$(( (-9223372036854775807 - 1) / -1 ))",
    "$(( 5 > 3 ? 10 : 20 ))",
    "$(( N = 4, N * 2 ))",
    "$(( A + 1 ))",  # A holds the expression 2*3
    "$(( ${#S} * 2 ))",
    "$(( U + 1 ))",  # unset: 0
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_arithmetic_is_what_bash_prints(tmp_path):
    words = " ".join(f'"{expression}"' for expression in ARITHMETIC)
    body = f"A=2*3\nS=abcd\nprintf '%s\\n' {words}\n{TRAINER} {words}\n"
    script = tmp_path / "run.sh"
    script.write_text(body)
    expected = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": os.defpath})
    launch = read_launch_script(script)
    assert list(launch.overrides) == expected.stdout.split("\n")[: len(ARITHMETIC)]


def test_a_huge_power_takes_no_time(tmp_path):
    start = time.perf_counter()
    launch = within(10, lambda: read(tmp_path, f"{TRAINER} x=$(( 10 ** (10 ** 10) )) y=$(( 7 ** 99999999999 ))\n"))
    assert time.perf_counter() - start < 2
    assert launch.overrides == ("x=0", f"y={pow(7, 99999999999, 2**64) - 2**64}")


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("(" * 300 + "1" + ")" * 300, "nests deeper than"),
        ("-" * 300 + "1", "nests deeper than"),
        ("A", "refer to each other deeper than"),  # A=A: bash says "expression recursion level exceeded"
        ("1" + "+1" * 40000, "longer than"),
    ],
)
def test_arithmetic_beyond_the_bounds_could_not_be_evaluated(tmp_path, expression, why):
    launch = within(10, lambda: read(tmp_path, f"A=A\n{TRAINER} x=$(( {expression} ))\n"))
    assert launch.overrides[0].startswith("x=<$((")
    assert launch.unknowns == (launch.overrides[0].removeprefix("x="),)
    (finding,) = [f for f in findings(launch, "unresolved") if "could not evaluate" in f.message]
    assert why in finding.message and finding.severity == "warning"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_an_arithmetic_error_abandons_its_top_level_command_as_bash_does(tmp_path):
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nshift 2\nprintf "%s\\0" "$@" >> "$OUT"\n')
    stub.chmod(0o755)
    body = "X=7\nX=$(( 1 / 0 ))\nf() { Y=$(( 2 % 0 )); Z=1; }\nZ=0\nf\n"
    body += f"{TRAINER} x=$X z=$Z\n{TRAINER} never=$(( 1 / 0 ))\n"
    script = tmp_path / "run.sh"
    script.write_text(body)
    env = {"PATH": f"{stub.parent}:{os.defpath}", "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", str(script)], env=env, check=False, capture_output=True)  # goes on after each error
    launch = read_launch_script(script, env=env)
    assert list(launch.overrides) == (tmp_path / "out").read_text().split("\0")[:-1] == ["x=7", "z=0"]
    assert not findings(launch, "multiple-trainers")  # the second trainer's line was abandoned
    errors = findings(launch, "arith-error")
    assert [(f.severity, f.line) for f in errors] == [("error", 2), ("error", 3), ("error", 7)]
    assert "division by 0" in errors[0].message and "bash abandons the command there" in errors[0].message


def test_an_arithmetic_error_in_a_command_only_fails_the_command(tmp_path):
    launch = read(tmp_path, f"(( 1 / 0 ))\nlet 'Y = 2 +'\n{TRAINER} x=1\n")
    assert [(f.severity, f.line) for f in findings(launch, "arith-error")] == [("warning", 1), ("warning", 2)]


def test_double_parentheses_and_let_assign(tmp_path):
    body = "(( N = 4 * 2 ))\n((N++))\nlet M=N+1 'K = M * 2'\nA=(1 2 3)\n(( A[1] += 40 ))\n"
    body += f"{TRAINER} n=$N m=$M k=$K a=${{A[1]}}\n"
    assert read(tmp_path, body).overrides == ("n=9", "m=10", "k=20", "a=42")


def test_an_operand_only_the_running_script_knows_is_unknown_not_a_bash_error(tmp_path):
    launch = read(tmp_path, f"CORES=$(nproc)\n{TRAINER} x=$(( CORES * 2 ))\n")
    assert launch.overrides == ("x=<$(( CORES * 2 ))>",) and not findings(launch, "arith-error")
    assert any("$(nproc)" in f.message for f in findings(launch, "unresolved"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_subscripts_and_substrings_from_the_end_are_as_bash_has_them(tmp_path):
    body = 'A=(a b c); S=abcdef\nprintf "%s\\n" "${A[-1]}" "${A[-3]}" "x${A[-5]}" "${S:1:-1}" "${S: -2}" "x${S:10}"\n'
    script = tmp_path / "run.sh"
    script.write_text(
        body + f'{TRAINER} "${{A[-1]}}" "${{A[-3]}}" "x${{A[-5]}}" "${{S:1:-1}}" "${{S: -2}}" "x${{S:10}}"\n'
    )
    expected = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": os.defpath})
    assert list(read_launch_script(script).overrides) == expected.stdout.split("\n")[:6]


# --- expansion and evaluation: bounded ----------------------------------------------------------------------------
def test_a_value_that_doubles_forty_times_is_a_placeholder_at_once(tmp_path):
    body = "A=xxxxxxxxxxxxxxxx\n" + "A=$A$A\n" * 40 + f"{TRAINER} a=$A b=${{#A}}\n"
    start = time.perf_counter()
    launch = within(10, lambda: read(tmp_path, body))
    assert time.perf_counter() - start < 3
    assert launch.overrides[0].removeprefix("a=").replace("<$A>", "") == ""  # unknown, and stays unknown
    assert any("could not evaluate $A" in f.message for f in findings(launch, "unresolved"))


def test_an_array_that_doubles_forty_times_is_a_placeholder_at_once(tmp_path):
    body = "B=(x)\n" + 'B+=("${B[@]}")\n' * 40 + f'{TRAINER} "${{B[@]}}"\n'
    launch = within(10, lambda: read(tmp_path, body))
    assert len(launch.overrides) < shell.MAX_ARRAY_ITEMS * 2
    assert any("could not evaluate $B" in f.message for f in findings(launch, "unresolved"))


def test_a_replacement_that_would_explode_is_not_performed(tmp_path):
    body = "A=" + "x" * 5000 + "\n" + f'{TRAINER} "${{A//x/{"y" * 1000}}}" "${{A//}}"\n'
    launch = within(10, lambda: read(tmp_path, body))
    assert launch.overrides[0].startswith("<${A//x/") and launch.overrides[1] == "x" * 5000


def test_functions_that_call_each_other_exponentially_stop_at_the_step_bound(tmp_path):
    lines = ["f0() { A=1; }"] + [f"f{i}() {{ f{i - 1}; f{i - 1}; }}" for i in range(1, 40)] + ["f39", f"{TRAINER} a=1"]
    start = time.perf_counter()
    launch = within(30, lambda: read(tmp_path, "\n".join(lines) + "\n"))
    assert time.perf_counter() - start < 10
    (bound,) = [f for f in findings(launch, "unresolved") if f"more than {shell.MAX_STEPS} statements" in f.message]
    assert bound.severity == "warning"


def test_constructs_nested_thousands_deep_are_an_error_not_a_traceback(tmp_path):
    launch = within(30, lambda: read(tmp_path, f"{TRAINER} x=" + "${A:-" * 3000 + "z" + "}" * 3000 + "\n"))
    assert any("nest deeper than preflight follows" in f.message for f in launch.findings if f.severity == "error")


@pytest.mark.parametrize(("count", "left"), [("9" * 5000, ("a=1", "b=2")), ("5", ("a=1", "b=2")), ("", ("b=2",))])
def test_shift_past_the_arguments_shifts_nothing_as_in_bash(tmp_path, count, left):
    # bash: "numeric argument required" for 5000 digits, "shift count out of range" for 5 of 2
    assert read(tmp_path, f'shift {count}\n{TRAINER} "$@"\n', args=["a=1", "b=2"]).overrides == left


# --- source: regular files only -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev-stdin", "directory"])
def test_source_of_something_that_is_not_a_regular_file_is_not_read(tmp_path, kind):
    target = {"fifo": tmp_path / "pipe", "dev-stdin": Path("/dev/stdin"), "directory": tmp_path / "dir"}[kind]
    if kind == "fifo":
        os.mkfifo(target)  # nobody ever writes into it: reading it would block forever
    elif kind == "directory":
        target.mkdir()
    launch = within(10, lambda: read(tmp_path, f"source {target}\n{TRAINER} a=${{A:-1}}\n"))
    (finding,) = findings(launch, "unresolved")
    assert str(target) in finding.message and finding.severity == "warning"
    if kind != "directory":
        assert "not a regular file" in finding.message
    assert launch.overrides == ("a=1",)


def test_a_sourced_file_beyond_the_size_cap_is_not_read(tmp_path):
    big = tmp_path / "big.env"
    with big.open("wb") as f:
        f.truncate(shell.MAX_SCRIPT_BYTES + 1)  # sparse: no disk used
    launch = read(tmp_path, f"source {big}\n{TRAINER} a=1\n")
    assert any("larger than" in f.message and "big.env" in f.message for f in findings(launch, "unresolved"))


def test_a_launch_script_that_is_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "run.sh"
    os.mkfifo(fifo)
    with pytest.raises(LaunchError, match="not a regular file"):
        within(10, lambda: read_launch_script(fifo))


# --- values only the running script knows --------------------------------------------------------------------------
def test_a_variable_set_only_inside_a_for_loop_is_unknown_not_unset(tmp_path):
    launch = read(tmp_path, f"set -u\nfor n in 1 2; do NODES=$n; done\n{TRAINER} trainer.nnodes=$NODES\n")
    assert launch.overrides == ("trainer.nnodes=<$NODES>",) and launch.unknowns == ("<$NODES>",)
    assert not findings(launch, "unset-variable")
    (finding,) = findings(launch, "unresolved")
    assert "inside a for loop (line 2)" in finding.message and "gets <$NODES>" in finding.message


def test_placeholders_compose_as_sentinels_and_read_back_in_messages(tmp_path):
    from verl_npu.preflight import unknowns

    launch = read(tmp_path, f"{TRAINER} trainer.experiment_name=run_$(date +%Y%m%d) a=$(( $(nproc) + 1 ))\n")
    assert launch.unknowns == ("<$(date +%Y%m%d)>", "<$(( $(nproc) + 1 ))>")
    overrides, mapping = launch.hydra_overrides()
    assert all("<" not in o and "$" not in o for o in overrides)
    assert unknowns.restore(" ".join(overrides), mapping) == " ".join(launch.overrides)


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("--config-path=/c --config-name=x a=1", ("x", "/c", None)),
        ("-cp /c -cn x -cd /d a=1", ("x", "/c", "/d")),
        ("--config-dir=/d a=1 --config-path /e", (None, "/e", "/d")),
    ],
)
def test_hydras_config_options_are_not_overrides(tmp_path, words, expected):
    for launch in (read(tmp_path, f"{TRAINER} {words}\n"), launch_from_overrides(words.split())):
        assert (launch.config_name, launch.config_path, launch.config_dir) == expected
        assert launch.overrides == ("a=1",)


# --- what the fuzz suite found (tests_npu/fuzz/test_fuzz_launch.py), kept as regular tests -------------------------
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize(
    "expression",
    [
        "1 || 1/0",  # a skipped operand divides by 0 silently
        "1 || 2 ** -1",  # but a negative exponent is an error even there (bash 5.2)
        "0 ? 2**-1 : 3",
        "1 ? 2 : 1/0",
        "0 + 0 && 0 + 0 ** -A + 0",  # a skipped operand reads no variable: -A is 0 there
        "1 || (Q = 5)",  # and assigns nothing
        "0 + 0 , 0 + 0",
    ],
)
def test_operands_bash_skips_are_checked_as_bash_checks_them(tmp_path, expression):
    body = f'A=6\nX=none\nX=$(( {expression} ))\necho "$X $Q"\n{TRAINER} x=$X q=$Q\n'
    bash = subprocess.run(["bash", "-c", body.replace(TRAINER, ":")], capture_output=True, text=True, timeout=10)
    launch = read(tmp_path, body)
    value, q = [*bash.stdout.split(), ""][:2]
    assert launch.overrides == (f"x={value}", f"q={q}")
    assert bool(findings(launch, "arith-error")) == bool(bash.stderr.strip())


def test_a_script_that_is_not_utf8_is_read(tmp_path):
    script = tmp_path / "run.sh"
    script.write_bytes(b"\x80\nA=\xff\xfe\n" + TRAINER.encode() + b" a=$A\n")
    assert read_launch_script(script).overrides == ("a=\ufffd\ufffd",)


def test_source_of_a_path_with_a_nul_byte_is_not_read(tmp_path):
    launch = read(tmp_path, f'source "$1"\n{TRAINER} a=1\n', args=["x\x00y"])
    (finding,) = findings(launch, "unresolved")
    assert "NUL byte" in finding.message and launch.overrides == ("a=1",)


# --- what the review of the change found, each as bash has it -------------------------------------------------------
REVIEWED = [
    'S=(1 2 4 8); i=2\nS[$i]=9\n$T "${S[$i]}" "${S[@]}"',  # an index that is one expansion
    'x=abc\n$T "x${x: -5}" "${x: -2}" "${x##"*"}" "${x%%"b"*}" "${x/"*"/Q}"',  # offsets past the start; quoted patterns
    '$T "${@: -1}" "${@: -2:1}" "${@:1:1}" "${#@}"',  # positional slices from the end
    'A=(a b c)\nA[-5]=x\n$T "${A[@]}"',  # bash: bad array subscript, nothing assigned
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("body", REVIEWED)
def test_expansions_the_review_found_are_what_bash_passes(tmp_path, body):
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nshift 2\nprintf "%s\\0" "$@" > "$OUT"\n')
    stub.chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text('T="python3 -m verl.trainer.main_ppo"\n' + body + "\n")
    args = ["k=1", "l=2", "m=3"]
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", str(script), *args], env=env, check=False, capture_output=True)
    assert list(read_launch_script(script, args, env).overrides) == (tmp_path / "out").read_text().split("\0")[:-1]


def test_a_negative_subscript_past_the_start_assigns_nothing_and_says_so(tmp_path):
    launch = read(tmp_path, f"A=(a b c)\nA[-5]=x\n(( A[-7] = 1 ))\n{TRAINER} " + '"${A[@]}"\n')
    assert launch.overrides == ("a", "b", "c")
    assert [(f.severity, f.line) for f in findings(launch, "arith-error")] == [("warning", 2), ("warning", 3)]


@pytest.mark.parametrize(
    "body",
    [
        "S=(1 2)\n{T} a=${{S[$(cat f)+0]}}\n",  # an index only the running script knows
        "for t in 1; do A=$t; done\n{T} a=$(( $A + 1 ))\n",  # an operand set only in a loop
        'for t in 1; do A=$t; done\nB="${{A}}1"\n{T} a=$(( B + 1 ))\n',  # ... reached through another variable
        "S=(1 2)\nS[$(cat f)]=3\n{T} a=${{S[0]}}\n",  # an assignment at an unknown index
    ],
)
def test_a_value_behind_an_unknown_is_a_placeholder_never_a_number(tmp_path, body):
    launch = read(tmp_path, body.format(T=TRAINER))
    (override,) = launch.overrides
    assert override.startswith("a=<") and launch.unknowns, override
    assert not findings(launch, "arith-error") and not findings(launch, "no-trainer")


def test_positional_parameters_with_thousands_of_digits_are_unset(tmp_path):
    assert read(tmp_path, f"{TRAINER} a=${{{'1' * 5000}:-none}}\n", args=["x"]).overrides == ("a=none",)


@pytest.mark.parametrize("kind", ["symlink-loop", "long-name", "proc-mem"])
def test_sourced_paths_that_cannot_be_resolved_or_read_are_warnings(tmp_path, kind):
    if kind == "symlink-loop":
        (tmp_path / "loop.sh").symlink_to(tmp_path / "loop.sh")
        word = "loop.sh"
    elif kind == "long-name":
        word = "x" * 300 + ".sh"
    else:
        word = "/proc/self/mem"  # a regular file whose read fails (EIO)
    launch = within(10, lambda: read(tmp_path, f"source {word}\n{TRAINER} a=1\n"))
    (finding,) = findings(launch, "unresolved")
    assert finding.severity == "warning" and launch.overrides == ("a=1",)


def test_splitting_a_megabyte_of_spaces_is_linear(tmp_path):
    body = 'A="a b $(x) "\n' + 'A="$A$A"\n' * 16 + f"{TRAINER} $A\n"
    start = time.perf_counter()
    launch = within(20, lambda: read(tmp_path, body))
    assert time.perf_counter() - start < 5
    assert len(launch.overrides) == 3 * 2**16 and launch.overrides[2] == "<$(x)>"


def test_trimming_is_bounded_over_the_whole_script(tmp_path):
    body = "A=" + "a/" * 4000 + "\n" + "B=${A##*/}\n" * 200 + f"{TRAINER} b=$B\n"
    start = time.perf_counter()
    launch = within(60, lambda: read(tmp_path, body))
    assert time.perf_counter() - start < 20
    assert launch.overrides == ("b=<${A##*/}>",)


def test_expressions_that_expand_exponentially_are_bounded(tmp_path):
    body = "V16=1\n" + "".join(f"V{i}='V{i + 1}+V{i + 1}'\n" for i in range(15, 0, -1))
    launch = within(20, lambda: read(tmp_path, body + f"{TRAINER} x=$((V1)) y=$((V3))\n"))
    assert launch.overrides == ("x=<$((V1))>", "y=8192")  # bash: 32768 and 8192
    assert any("variable expansions" in f.message for f in findings(launch, "unresolved"))
