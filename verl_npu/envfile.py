"""A cluster's env file (``NAME=VALUE`` lines, as ``ray_start.sh`` sources it), read without a shell.

The same file reaches processes two ways: the head's scripts run ``set -a; source FILE`` (bash parses it),
while `verl-npu k8s render` puts each value into the pods' spec and verl-npu forwards them to Ray workers
(this reader). The two agree only where bash's assignment is literal, so the reader accepts exactly those
values and refuses the rest, naming the file, line, key and character: a bare value of characters bash
gives no meaning to, a value in single quotes (no single quote inside), or one in double quotes without
``$``, `````, ``\\``, ``"`` or ``!``. A key given twice is refused too (which copy wins would differ between
``source`` and the pod spec). tests_npu/test_envfile.py checks the reader against bash itself.

Kept free of heavy imports: `verl-npu k8s render` reads env files, and the runtime patch that
forwards their variables to Ray workers (verl_npu.runtime_patches.ray_runtime_env, which re-exports
``env_file_variables``) lives in a package that imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import re

from verl_npu.bounded_read import MIB, read_text

MAX_ENV_FILE_BYTES = MIB  # the shipped env files are a few KiB

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # bash's names are ASCII: anything else is run as a command
_ASSIGNMENT = re.compile(r"(?:export[ \t]+)?(?P<name>[^=]*)=(?P<value>.*)", re.S)
# Characters an unquoted value may hold: none of them is an operator, quote, expansion, pattern or blank to
# bash, with or without `export` (which brace-expands `{1,2}` and tilde-expands `~`).
_BARE = re.compile(r"[A-Za-z0-9_@%+,./:=\[\]-]*")
_DOUBLE_QUOTED_SPECIAL = '$`\\"!'
# Variables bash gives a meaning of its own: an assignment errors (read-only), is replaced at once, or
# changes the shell (RANDOM seeds, SECONDS resets, IFS re-splits), so the value read back is not the one written.
_SPECIAL_NAMES = frozenset({
    "_", "RANDOM", "SRANDOM", "SECONDS", "LINENO", "UID", "EUID", "PPID", "GROUPS", "FUNCNAME", "HISTCMD",
    "SHELLOPTS", "BASHOPTS", "EPOCHREALTIME", "EPOCHSECONDS", "DIRSTACK", "PIPESTATUS", "OPTIND", "OPTARG", "IFS",
    "COMP_WORDBREAKS",
})  # fmt: skip
_WHY = {
    "$": "starts an expansion ($VAR, ${VAR}, $(command)) when the head sources the file",
    "`": "starts a command substitution when the head sources the file",
    "\\": "is an escape: bash removes it",
    "~": "expands to a home directory",
    "'": "is a quote: bash removes it",
    '"': "is a quote: bash removes it",
    " ": "ends the assignment: bash runs the rest of the line as a command",
    "\t": "ends the assignment: bash runs the rest of the line as a command",
    "{": "is brace expansion after `export` ({a,b} becomes two words)",
    "}": "is brace expansion after `export` ({a,b} becomes two words)",
    "*": "is a glob pattern",
    "?": "is a glob pattern",
    "#": "starts a comment after a blank",
    "!": "is history expansion in an interactive shell",
}
_FIX = (
    "write the literal value (no expansions: each process reads the same text), in single quotes if it holds "
    "spaces or shell characters"
)


class EnvFileError(ValueError):
    """An env file line bash's `source` would read otherwise than this reader, or not as NAME=VALUE at all."""


@dataclasses.dataclass(frozen=True)
class EnvFile:
    path: str
    text: str
    variables: dict[str, str]
    lines: dict[str, int]  # the line (1-based) that sets each variable


def _character(char: str) -> str:
    return f"{char!r} (U+{ord(char):04X})" if not char.isprintable() or char.isspace() else repr(char)


def value_problem(text: str) -> tuple[str, str] | None:
    """(character, why) of the first character of the value text ``text`` (what follows ``NAME=``) that bash
    would not take literally; None when bash's assignment gives exactly :func:`literal_value`."""
    if len(text) >= 2 and text[0] == text[-1] == "'":
        inner = text[1:-1]
        return ("'", "ends the single-quoted part inside the value") if "'" in inner else None
    if len(text) >= 2 and text[0] == text[-1] == '"':
        bad = next((c for c in text[1:-1] if c in _DOUBLE_QUOTED_SPECIAL), None)
        return (bad, _WHY.get(bad, "is special inside double quotes")) if bad else None
    bad = next((c for c in text if not _BARE.fullmatch(c)), None)
    if bad is None:
        return None
    return bad, _WHY.get(bad, "is not a character an unquoted value may hold (letters, digits and _@%+,./:=[]-)")


def literal_value(text: str) -> str:
    """The value of an assignment text that :func:`value_problem` accepts: its quotes removed."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def assignment_text(name: str, value: str) -> str:
    """``NAME=VALUE`` as a line both bash and this reader read back as ``value``; EnvFileError when no such line
    exists (a single quote, a newline or another character that is not printable)."""
    if not _NAME.fullmatch(name) or name in _SPECIAL_NAMES or name.startswith("BASH"):
        raise EnvFileError(f"{name!r} is not a variable name an env file may set (ASCII letters, digits and _)")
    bad = next((c for c in value if not (c.isprintable() or c == "\t")), None)
    if bad is not None:
        raise EnvFileError(f"{name}: the value holds {_character(bad)}, a character that is not printable")
    if _BARE.fullmatch(value):
        return f"{name}={value}"
    if "'" in value:
        raise EnvFileError(f"{name}: the value holds both a single quote and characters that need quoting")
    return f"{name}='{value}'"


def parse_env_text(text: str, source: str) -> EnvFile:
    """The variables of env file text; EnvFileError names the line, the key and the character bash reads otherwise."""
    variables: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        where = f"{source}:{number}"
        bad = next((c for c in raw if not (c.isprintable() or c == "\t")), None)
        if bad is not None:
            hint = " (CRLF line endings: convert the file with dos2unix)" if bad == "\r" else ""
            raise EnvFileError(
                f"{where}: {_character(bad)} is not printable: bash and YAML read it otherwise than this reader{hint}"
            )
        line = raw.strip(" \t")
        if not line or line.startswith("#"):
            continue
        match = _ASSIGNMENT.fullmatch(line)
        name = match["name"] if match else ""
        if not match or not _NAME.fullmatch(name):
            raise EnvFileError(f"{where}: expected NAME=VALUE (NAME of ASCII letters, digits and _), got {raw!r}")
        if name in _SPECIAL_NAMES or name.startswith("BASH"):
            raise EnvFileError(f"{where}: {name} is a variable bash gives a meaning of its own: use another name")
        problem = value_problem(match["value"])
        if problem is not None:
            char, why = problem
            raise EnvFileError(f"{where}: {name}: {_character(char)} {why}, while pods get the text as written: {_FIX}")
        if name in variables:
            raise EnvFileError(
                f"{where}: {name} is set again (first on line {lines[name]}): `source` keeps the last value, the pod "
                "spec one of them: keep one line"
            )
        variables[name], lines[name] = literal_value(match["value"]), number
    return EnvFile(source, text, variables, lines)


def read_env_file(path: str | os.PathLike[str]) -> EnvFile:
    """The env file at ``path``; NotReadable (verl_npu.bounded_read) when it is not read, EnvFileError when a
    line is not one bash and this reader read alike."""
    return parse_env_text(read_text(path, MAX_ENV_FILE_BYTES), os.fspath(path))


def env_file_variables(path: str) -> dict[str, str]:
    """``KEY=VALUE`` / ``export KEY=VALUE`` lines of a shell env file, as bash's ``source`` sets them."""
    return read_env_file(path).variables
