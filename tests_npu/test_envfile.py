"""verl_npu.envfile: the env file reader accepts a line only where bash's `set -a; source` sets the same value.

bash is the oracle: every value the reader accepts is sourced by `env -i bash` and must print the same text.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.bounded_read import NotReadable
from verl_npu.envfile import EnvFileError, assignment_text, env_file_variables, parse_env_text, read_env_file

SHIPPED = (REPO / "examples/glm5_2/glm5_2.env", REPO / "ci/nightly/nightly.env")


def sourced(path: Path, names: list[str]) -> dict[str, str]:
    """What `set -a; source PATH` sets for ``names`` in an empty environment (HOME given: `~` would expand)."""
    script = 'set -a; source "$1" >/dev/null 2>&1; shift; for n in "$@"; do printf "%s\\0" "${!n-<unset>}"; done'
    done = subprocess.run(
        ["env", "-i", "HOME=/home/someone", "PATH=/usr/bin:/bin", "bash", "-c", script, "-", str(path), *names],
        capture_output=True, check=True, cwd=path.parent,
    )  # fmt: skip
    return dict(zip(names, done.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1], strict=True))


def agree_with_bash(tmp_path: Path, texts: list[str]) -> tuple[dict[str, str], list[str]]:
    """(accepted value texts -> value, refused value texts); asserts bash reads every accepted one alike."""
    accepted, refused = {}, []
    for text in texts:
        try:
            accepted[text] = parse_env_text(f"K={text}\n", "t.env").variables["K"]
        except EnvFileError:
            refused.append(text)
    path = tmp_path / "all.env"
    path.write_text("".join(f"K{i}={text}\n" for i, text in enumerate(accepted)))
    names = [f"K{i}" for i in range(len(accepted))]
    assert sourced(path, names) == dict(zip(names, accepted.values(), strict=True))
    return accepted, refused


# Value texts (what follows NAME=) bash reads otherwise than as written, from the hostile rounds and their variants.
EXPANDED = [
    "$CKPT_DIR/x", "${CKPT_DIR}/x", "$(echo x)", "`echo x`", "~/x", "/a:~/x", "~root", "{1,2}", "a b", "a\tb",
    "a;touch pwned", "a&", "a|b", "a>f", "a<f", "(a)", "a\\b", "a\\", "'a'b", "a'b'", '"a"b', "'a'\"b\"", "a #c",
    "\"$HOME\"", '"a\\"b"', '"`x`"', "'", '"', "$'x\\ty'", "a*", "a?", "!x",
]  # fmt: skip
LITERAL = [
    "/checkpoints/glm5_2_grpo/x", "verl_npu.megatron_adaptor", "[/a.parquet,/b.parquet]", "a=b:c,d@e%f+g",
    "", "'two words'", "'$HOME `x` \\ ~ {1,2} ; & | < > ( ) # !'", '"two words"', '"~/x {1,2} * ?"', "''", '""',
    "'a\tb'", "'é ü'", "-x", "a-b.c_d",
]  # fmt: skip


def test_every_value_the_reader_accepts_bash_sources_alike(tmp_path):
    accepted, refused = agree_with_bash(tmp_path, EXPANDED + LITERAL)
    assert sorted(refused) == sorted(EXPANDED)
    assert accepted["'two words'"] == "two words" and accepted["[/a.parquet,/b.parquet]"] == "[/a.parquet,/b.parquet]"


def test_a_value_with_an_expansion_names_the_file_line_key_and_character(tmp_path):
    path = tmp_path / "cluster.env"
    path.write_text("# cluster\nCKPT_DIR=/checkpoints/run\nCKPT2=$CKPT_DIR/x\n")
    with pytest.raises(EnvFileError) as exc:
        env_file_variables(str(path))
    message = str(exc.value)
    assert message.startswith(f"{path}:3: CKPT2: '$' starts an expansion")
    assert "write the literal value" in message
    assert sourced(path, ["CKPT2"]) == {"CKPT2": "/checkpoints/run/x"}  # what the head would have had


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\r\nB=2\r\n", r"t\.env:1: '\\r' \(U\+000D\) is not printable.*dos2unix"),
        ("A=1\nB=2\nA=3\n", r"t\.env:3: A is set again \(first on line 1\)"),
        ("A= b\n", r"t\.env:1: A: ' ' \(U\+0020\) ends the assignment"),
        ("A =b\n", r"t\.env:1: expected NAME=VALUE"),
        ("ÄB=1\n", r"t\.env:1: expected NAME=VALUE \(NAME of ASCII"),
        ("RANDOM=4\n", r"t\.env:1: RANDOM is a variable bash gives a meaning of its own"),
        ("# note\x85touch pwned\nA=1\n", r"t\.env:1: '\\x85' \(U\+0085\) is not printable"),
        ("\ufeffA=1\n", r"t\.env:1: '\\ufeff' \(U\+FEFF\) is not printable"),
        ("export F={64,128}\n", r"t\.env:1: F: '\{' is brace expansion after `export`"),
    ],
)
def test_lines_bash_reads_otherwise_are_refused_naming_the_line(text, expected):
    with pytest.raises(EnvFileError, match=expected):
        parse_env_text(text, "t.env")


def test_the_refused_lines_do_differ_in_bash(tmp_path):
    """The refusals above are real: bash sets another value, or none (CRLF keeps the CR, `A= b` runs `b`)."""
    path = tmp_path / "t.env"
    for text, name, literal in (("A=1\r\n", "A", "1"), ("A= b\n", "A", "b"), ("export F={64,128}\n", "F", "{64,128}")):
        path.write_text(text)
        assert sourced(path, [name])[name] != literal


def test_the_shipped_env_files_read_as_bash_sources_them():
    for path in SHIPPED:
        variables = env_file_variables(str(path))
        assert variables and sourced(path, list(variables)) == variables


@pytest.mark.parametrize(
    "value", ["plain", "two words", "$HOME/`x`", "a\\b ~ {1,2}", "", "tab\there", "é", "[/a,/b]", "a;b&c|d"]
)
def test_assignment_text_reads_back_the_same_in_bash_and_the_reader(tmp_path, value):
    path = tmp_path / "w.env"
    path.write_text(assignment_text("W", value) + "\n")
    assert env_file_variables(str(path)) == {"W": value} == sourced(path, ["W"])


@pytest.mark.parametrize("value", ["it's", "a\nb", "a\rb", "\x1b[31m", "a\x85b"])
def test_assignment_text_refuses_values_no_line_can_hold(value):
    with pytest.raises(EnvFileError, match="W: the value holds"):
        assignment_text("W", value)


def test_files_that_are_not_regular_or_too_large_are_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)  # no writer: opening it for reading without O_NONBLOCK would block
    with pytest.raises(NotReadable, match="not a regular file but a FIFO"):
        read_env_file(fifo)
    with pytest.raises(NotReadable, match="not a regular file but a directory"):
        read_env_file(tmp_path)
    with pytest.raises(NotReadable, match="not a regular file but a character device"):
        read_env_file("/dev/zero")
    big = tmp_path / "big.env"
    with big.open("wb") as handle:
        handle.truncate(1 << 30)  # sparse: no disk used
    with pytest.raises(NotReadable, match="larger than 1 MiB"):
        read_env_file(big)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s.env"))
        with pytest.raises(NotReadable, match="not a regular file but a socket"):
            read_env_file(tmp_path / "s.env")
