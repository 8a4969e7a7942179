"""A static evaluator for bash scripts: what a script's commands would receive, without running anything.

The script is parsed with tree-sitter's bash grammar and evaluated in statement order: assignments, exports,
parameter expansions, arithmetic, arrays, ``set -u``/``set -a``, ``source`` and functions called at top level.
A subclass says which commands it is looking for (``recognize``); the evaluator hands it each one with its words
expanded as bash would, and records findings (unset variables, syntax errors) on the way.

Static on purpose: the scripts it reads may start Ray, write files or submit jobs, and must be safe to read anywhere.
What only running a command would tell (``$(...)``, values assigned under ``if`` or in loops) is kept as a visible
placeholder such as ``<$(uname -m)>`` and reported; :attr:`StaticShell.placeholders` lists every one made.

Read as bash runs it: a carriage return (CRLF) and a blank after a line-continuation backslash change what bash
runs, so each is an error finding naming its line (the text is then read as its author meant it); words are
brace-expanded as bash does (:mod:`verl_npu.preflight.braces`); ``exit``, ``return`` and ``exec`` end the script,
function or file where they run, and the conditions of ``if``, ``case``, loops and ``&&``/``||`` are evaluated where
preflight knows them (:mod:`verl_npu.preflight.flow`), so a recognised command or an exit under a condition is
judged reached, never reached, or unknown.

Bounded on purpose too, since a script is input from outside: arithmetic is bash's 64-bit arithmetic with a depth
limit (:mod:`verl_npu.preflight.arith`), a value longer than :data:`MAX_VALUE_CHARS` (or an array of more than
:data:`MAX_ARRAY_ITEMS`) becomes a placeholder, evaluation stops after :data:`MAX_STEPS` statements, and ``source``
reads regular files of at most :data:`MAX_SCRIPT_BYTES` only (never a FIFO or ``/dev/stdin``, which could block
forever). What is beyond a bound is reported as a warning ("could not evaluate ..."), never guessed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

from verl_npu.bounded_read import NotReadable, read_bytes
from verl_npu.preflight import braces
from verl_npu.preflight.arith import Arith, ArithError, Limit
from verl_npu.preflight.flow import NO, UNKNOWN, Cond, Flow, Unknown, decide

NAME = re.compile(r"[A-Za-z_]\w*")
# $(dirname "$0") and $(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) name the script's own folder: known statically.
_SELF_DIR = re.compile(r"(?:cd\s+\$\()?dirname\s+\$\{?(0|BASH_SOURCE(?:\[0\])?)\}?\)?(?:\s*(?:&&|;)\s*pwd(?:\s+-P)?)?")
# Set by bash itself, so never unset, but their values belong to the machine that runs the script.
_SHELL_PROVIDED = re.compile(r"PWD|OLDPWD|HOME|USER|HOSTNAME|UID|EUID|RANDOM|SECONDS|PPID|BASHPID|SHELL|PATH")
_IFS = re.compile(r"[ \t\n]+")
_ANSI = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "v": "\v"}
_BLOCKS = {"if_statement": "an if block", "case_statement": "a case block", "while_statement": "a while/until loop"}
_BLOCKS |= {"for_statement": "a for loop", "c_style_for_statement": "a for loop"}
CHAINS = {"pipeline", "list", "redirected_statement", "negated_command"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}
LIT, QUOTED, UNQUOTED, BREAK = "lit", "quoted", "unquoted", "break"  # kinds of word pieces, see _fields
Pieces = list[tuple[str, str]]

# Bounds on the work one script can ask for (module docstring); no real launch script comes near them.
MAX_SCRIPT_BYTES = 4 << 20  # one script or sourced file
MAX_VALUE_CHARS = 1 << 20  # one variable's value or one word
MAX_ARRAY_ITEMS = 1 << 16  # one array
MAX_STEPS = 20_000  # statements evaluated, functions and sourced files included
MAX_SOURCED_BYTES = 64 << 20  # every sourced file together (the same file sourced again counts again)
MAX_TRIM_WORK = 50_000_000  # ${x#pattern} tries every cut of the value: len(value)**2 / 2 characters each time
# what bash expands inside $((...)) before it evaluates the text
_ARITH_EXPANSIONS = {"simple_expansion", "expansion", "command_substitution", "arithmetic_expansion", "string"}
_ARITH_EXPANSIONS |= {"raw_string", "ansi_c_string"}


class _Unknown(Exception):
    """An arithmetic operand holds a value only running the script would tell."""


class _Abandoned(Exception):
    """Bash failed on an expansion ($((1/0)), a bad subscript): it abandons the file's current top-level command."""


class TooLarge(Exception):
    """A word or value would hold more than MAX_VALUE_CHARS characters (raised before it is joined)."""


class _Exit(Exception):
    """``exit`` (or ``exec`` of another program) ran: bash ends the script, whatever file or function it is in."""

    def __init__(self, line: int, text: str, status: int = 0) -> None:
        super().__init__(text)
        self.line, self.text, self.status = line, text, status


class _Return(_Exit):
    """``return`` ran in a function or a sourced file: bash leaves that function or file."""


# the end of a line as bash reads it otherwise than it looks: `\` then spaces or tabs (an escaped blank, no line
# continuation: the command ends there)
_BLANK_AFTER_BACKSLASH = re.compile(rb"(?<!\\)(?:\\\\)*\\([ \t]+)(?=\n)")
# where a backslash at the end of a line is text, not bash syntax
_TEXT_NODES = {"comment", "raw_string", "string", "ansi_c_string", "heredoc_body", "heredoc_content", "heredoc_end"}
_LEAVING = ("exit", "return", "exec")


def _bounded(pieces: Pieces) -> Pieces:
    # pieces refer to values already held; only joining them would allocate, so the size is checked first
    if sum(len(text) for _, text in pieces) > MAX_VALUE_CHARS:
        raise TooLarge
    return pieces


def _short(text: str, limit: int = 80) -> str:
    """Script text for a message: one line, at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


ScriptFileError = NotReadable  # a script or sourced file that is not read (verl_npu.bounded_read)


def read_script_file(path: Path, limit: int = MAX_SCRIPT_BYTES) -> bytes:
    """A script's bytes: a regular file of at most ``limit`` bytes, read without ever blocking (FIFOs, terminals,
    ``/dev/stdin`` and devices are refused); raises ScriptFileError."""
    return read_bytes(path, limit)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long, a NUL
        return False


def _resolved(path: Path) -> Path:
    """``path.resolve()``, or its absolute form where resolving fails (a symlink loop, a name too long)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        return Path(os.path.abspath(path))


def _size(value: str | list[str]) -> int:
    return sum(map(len, value)) + len(value) if isinstance(value, list) else len(value)


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    code: str  # unset-variable, required-variable, unparsed, unresolved; a subclass adds its own
    message: str
    line: int | None


_DEFAULT_OPS = (":-", "-", ":=", "=", ":?", "?", ":+", "+")


@dataclass(frozen=True)
class _Param:
    """One parameter expansion being evaluated: its node, the nodes after the name, and the value found."""

    node: Node
    rest: list[Node]
    hi: int  # where the operand ends (before the closing brace)
    name: str
    val: str | list[str] | None
    star: bool
    quoted: bool
    line: int


class Taint:
    """What a value depends on, to report if it reaches a recognised command; variables carry theirs."""

    def __init__(self) -> None:
        self.unknown: dict[str, int] = {}  # message -> line
        self.unset: dict[tuple[str, int, bool], None] = {}  # (name, line, under set -u)
        self.uncertain: dict[tuple[str, int, str], None] = {}  # (name, line, block)
        self.required: list[tuple[str, str, int]] = []  # ${X:?msg} that fired: (name, msg, line)
        self.braced: dict[tuple[int, str], tuple[str, ...]] = {}  # (line, word) -> the words brace expansion made
        self.passthrough = False

    def merge(self, other: Taint | None) -> None:
        if other is not None:
            self.unknown |= other.unknown
            self.unset |= other.unset
            self.uncertain |= other.uncertain
            self.braced |= other.braced
            self.passthrough |= other.passthrough


@functools.cache
def _parser() -> Parser:
    return Parser(Language(tree_sitter_bash.language()))


def node_line(node: Node) -> int:
    return node.start_point.row + 1


def node_text(node: Node) -> str:
    return (node.text or b"").decode(errors="replace")  # a script is bytes: not every one is UTF-8


def _unescape(s: str, quoted: bool) -> str:
    pattern = r'\\([$`"\\\n])' if quoted else r"\\(.)"
    return re.sub(pattern, lambda m: "" if m[1] == "\n" else m[1], s, flags=re.S)


def _unquoted(s: str, lit: str) -> Pieces:
    """Unquoted script text: a backslash-escaped character is quoted (no brace, glob or split applies to it)."""
    out: Pieces = []
    for i, part in enumerate(re.split(r"\\(.)", s, flags=re.S)):
        if i % 2:
            if part != "\n":  # backslash-newline is a line continuation: nothing
                out.append((QUOTED, part))
        elif part:
            out.append((lit, part))
    return out


def _ansi(m: re.Match) -> str:
    code = m[1]
    return (
        chr(int(code[1:], 16) if code[0] == "x" else int(code, 8)) if code[0] in "x01234567" else _ANSI.get(code, code)
    )


def _fields(pieces: Pieces) -> list[str]:
    """Bash word splitting: only unquoted expansions split, and a quoted empty string is still a word."""
    _bounded(pieces)
    out: list[str] = []
    cur, have = "", False
    for kind, text in pieces:
        if kind == UNQUOTED:
            for i, part in enumerate(_split_ifs(text)):
                if i and have:
                    out.append(cur)
                    cur, have = "", False
                if part:
                    cur, have = cur + part, True
        elif kind == BREAK:
            if have:
                out.append(cur)
            cur, have = "", False
        elif kind == QUOTED or text:
            cur, have = cur + text, True
    return [*out, cur] if have else out


def _split_ifs(text: str) -> list[str]:
    """IFS whitespace splitting, except inside a <$(...)> placeholder, which stands for one unknown value.

    Linear in the text: a space splits unless the next angle bracket after it is a ``>`` (it is inside a
    placeholder).
    """
    if "<" not in text and ">" not in text:
        return _IFS.split(text)
    closes = [False] * (len(text) + 1)  # closes[i]: the first angle bracket at or after i is '>'
    for i in range(len(text) - 1, -1, -1):
        c = text[i]
        closes[i] = True if c == ">" else False if c == "<" else closes[i + 1]
    parts, start = [], 0
    for m in _IFS.finditer(text):
        if not closes[m.end()]:
            parts.append(text[start : m.start()])
            start = m.end()
    parts.append(text[start:])
    return parts


def join_pieces(pieces: Pieces) -> str:
    """An assignment's value: no word splitting, "$@" joined by spaces."""
    _bounded(pieces)
    return "".join(" " if kind == BREAK else text for kind, text in pieces)


def scalar(value: str | list[str]) -> str:
    return " ".join(value) if isinstance(value, list) else value


def _pattern(pieces: Pieces) -> str:
    """A bash pattern as fnmatch takes it: what was quoted in the script matches literally (``${x##"*"}``)."""
    escape = {"*": "[*]", "?": "[?]", "[": "[[]"}
    return "".join("".join(escape.get(c, c) for c in text) if kind == QUOTED else text for kind, text in pieces)


def _trim(value: str, op: str, pattern: str) -> str:
    cuts = range(len(value) + 1)
    for i in cuts if op in ("#", "%%") else reversed(cuts):
        if op[0] == "#" and fnmatchcase(value[:i], pattern):
            return value[i:]
        if op[0] == "%" and fnmatchcase(value[i:], pattern):
            return value[:i]
    return value


def descendants(node: Node, kind: str) -> Iterator[Node]:
    """The nodes of ``kind`` below ``node`` in document order, not inside a substitution (iterative: arithmetic such
    as ``1+1+...+1`` nests as deep as it is long)."""
    stack = list(reversed(node.named_children))
    while stack:
        child = stack.pop()
        if child.type == kind:
            yield child
        if child.type not in ("command_substitution", "process_substitution"):
            stack.extend(reversed(child.named_children))


@dataclass(frozen=True)
class Block:
    """A block preflight does not run, around a command it looks at: what it is, its line, the conditions on the
    command's path (verl_npu.preflight.flow)."""

    what: str
    line: int
    conds: tuple[Cond, ...]


class StaticShell(Flow):
    def __init__(self, path: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
        self.main = self.file = path
        self.vars: dict[str, str | list[str]] = dict(env)
        self.exported = set(env)
        self.taint: dict[str, Taint] = {}
        self.uncertain: dict[str, tuple[int, str]] = {}  # assigned in an unevaluated block: (line, block)
        self.args = list(args)
        self.nounset = self.allexport = self.errexit = self.pipefail = self.probing = False
        self.in_condition = 0  # evaluating the left side of && or ||, where set -e does not apply
        self.conditions: list[Cond] = []  # of the && / || lists being evaluated around the current command
        # (line, message, guard): an exit preflight cannot decide; a guard fails the run (exit N, N != 0)
        self.maybe_exits: list[tuple[int, str, bool]] = []
        self.exited: tuple[int, str] | None = None  # (line, text) of the exit that ended the script
        self.unreached: list[tuple[int, str]] = []  # (line, message): commands recognised where bash never runs
        self.functions: dict[str, tuple[Node, Path]] = {}
        self.active: list[object] = []  # files being sourced and functions running: recursion guard
        self.findings: list[Finding] = []
        self.placeholders: dict[str, None] = {}  # every <...> made for a value only running the script would tell
        self.steps = 0  # statements evaluated (MAX_STEPS)
        self.stopped = False  # past MAX_STEPS: nothing more is evaluated
        self.sourced_bytes = 0  # MAX_SOURCED_BYTES
        self.trim_work = 0  # MAX_TRIM_WORK

    TARGET = "the command"  # what the messages call a recognised command

    # what a subclass looks for

    def may_recognize(self, command: Node) -> bool:
        """Whether a command inside an unevaluated block may be one ``recognize`` takes (read as if the block ran)."""
        return False

    def recognize(self, node: Node, words: list[str], loose: bool, prefix: list[Node], ctx: Taint, block) -> bool:
        """Take a command the subclass is looking for; True means it was taken and is not run as a builtin.

        ``words`` are its expanded words, ``loose`` says its name did not resolve (``$PYTHON`` unset), ``prefix``
        its ``NAME=value`` assignments, ``block`` the unevaluated block it sits in (description, line) or None.
        """
        return False

    def report(self, severity: str, code: str, line: int | None, message: str) -> None:
        if self.file != self.main:
            message = f"{self.file.name}: {message}"
        self.findings.append(Finding(severity, code, message, line))

    # statements

    def run_file(self, path: Path, data: bytes) -> None:
        outer, self.file = self.file, path
        self.active.append(_resolved(path))
        try:
            tree = _parser().parse(self._as_meant(path, data))
            for bad in self._errors(tree.root_node) if tree.root_node.has_error else ():
                msg = f"line {node_line(bad)} is not valid bash (near {node_text(bad).split(chr(10))[0][:40]!r}); "
                msg += f"{self.TARGET} may be misread: check it with `bash -n`"
                self.report("error", "unparsed", node_line(bad), msg)
            for statement in tree.root_node.named_children:
                with contextlib.suppress(_Abandoned):  # bash goes on with the file's next top-level command
                    self._stmt(statement)
        except _Return:  # from a sourced file's top level (the main script's is refused in _leave)
            pass
        except _Exit as exc:
            if len(self.active) > 1:  # a sourced file: the exit ends the script that sourced it too
                raise
            self.exited = (exc.line, exc.text)
        except RecursionError:  # constructs nested thousands deep: the rest of this file is not evaluated
            msg = f"could not evaluate {path.name}: its constructs nest deeper than preflight follows; "
            msg += f"{self.TARGET} may be misread"
            self.report("error", "unparsed", None, msg)
        finally:
            self.file = outer
            self.active.pop()

    def _as_meant(self, path: Path, data: bytes) -> bytes:
        """The script as its author meant it, with a finding for each place where bash reads it otherwise: line ends
        with a carriage return (CRLF), and a line-continuation backslash followed by a space or tab."""
        if b"\r" in data:
            lines = [i + 1 for i, text in enumerate(data.split(b"\n")) if b"\r" in text]
            shown = ", ".join(map(str, lines[:5])) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")
            msg = f"line{'s' if len(lines) > 1 else ''} {shown} hold{'' if len(lines) > 1 else 's'} a carriage return "
            msg += "(CRLF line endings, as a Windows editor saves them): bash reads it as part of the line, so "
            msg += "`set -o pipefail` fails as an invalid option name, a `\\` before it continues no line (the "
            msg += "command ends there) and the last word of each line ends in a CR; preflight read the file without "
            msg += f"them. Convert it: dos2unix {path} (or sed -i 's/\\r$//' {path})"
            self.report("error", "crlf", lines[0], msg)
            data = data.replace(b"\r\n", b"\n")
        if not _BLANK_AFTER_BACKSLASH.search(data):
            return data
        root, cuts = _parser().parse(data).root_node, []
        for m in _BLANK_AFTER_BACKSLASH.finditer(data):
            node = root.descendant_for_byte_range(m.start(1) - 1, m.start(1))
            while node is not None and node.type not in _TEXT_NODES:
                node = node.parent
            if node is not None:  # inside quotes, a comment or a here-document: text, not a continuation
                continue
            line = data[: m.start()].count(b"\n") + 1
            blank = "a tab" if m[1] == b"\t" else "a space" if m[1] == b" " else "spaces or tabs"
            msg = f"line {line}: the `\\` at its end is followed by {blank}, so it escapes that instead of "
            msg += f"continuing the line: bash ends the command at line {line} and runs line {line + 1} as a command "
            msg += "of its own; the arguments on the lines after it never reach the command (preflight read the "
            msg += f"lines as continued). Delete what follows the `\\` on line {line}"
            self.report("error", "line-continuation", line, msg)
            cuts.append((m.start(1), m.end(1)))
        for start, end in reversed(cuts):
            data = data[:start] + data[end:]
        return data

    def _holds_placeholder(self, value: str | list[str] | None) -> bool:
        """Whether ``value`` holds one of this script's placeholders (a value only running it would tell)."""
        texts = value if isinstance(value, list) else [value or ""]
        return any("<" in t and any(marker in t for marker in self.placeholders) for t in texts)

    def placeholder(self, text: str, ctx: Taint, message: str, line: int | None) -> str:
        """The visible stand-in ``<text>`` for a value only running the script would tell, reported via ``ctx``."""
        marker = f"<{text}>"
        self.placeholders[marker] = None
        ctx.unknown[message] = line
        return marker

    def _errors(self, node: Node) -> Iterator[Node]:
        if node.is_missing:
            yield node
        elif node.type == "ERROR":
            # tree-sitter wraps the valid statements before a syntax error into the ERROR node too
            ok = {"command", "comment", "variable_assignment", "declaration_command", *CHAINS, *_BLOCKS}
            yield next((c for c in node.children if c.type not in ok), node)
        else:
            for child in node.children:
                if child.has_error or child.is_missing:
                    yield from self._errors(child)

    def _block(self, node: Node) -> None:
        for child in node.named_children:
            self._stmt(child)

    def _stmt(self, node: Node) -> None:
        if self.stopped:
            return
        self.steps += 1
        if self.steps > MAX_STEPS:
            self.stopped = True
            msg = f"could not evaluate the script past line {node_line(node)}: more than {MAX_STEPS} statements "
            msg += f"(functions and sourced files included); {self.TARGET} may be misread"
            self.report("warning", "unresolved", node_line(node), msg)
            return
        try:
            self._statement(node)
        except TooLarge:  # anywhere else (a pattern, a default's text): the statement is not evaluated
            msg = f"could not evaluate line {node_line(node)}: a value in it would be longer than {MAX_VALUE_CHARS} "
            self.report("warning", "unresolved", node_line(node), msg + f"characters; {self.TARGET} may be misread")

    def _statement(self, node: Node) -> None:
        kind = node.type
        if kind == "compound_statement" and node.children and node.children[0].type == "((":
            self._calc(node, Taint(), lo=node.children[0].end_byte, hi=node.children[-1].start_byte, stops=False)
        elif kind == "variable_assignment":
            self._assign(node)
        elif kind == "list":
            self._list(node)
        elif kind == "pipeline" and len(node.named_children) > 1:
            statuses = [self._in_subshell(child) for child in node.named_children]  # each runs in a subshell
            failed = next((s for s in statuses if s), None) if self.pipefail else statuses[-1]
            self._errexit(failed, node)
        elif kind in ("variable_assignments", "pipeline", "negated_command", "compound_statement", "ERROR"):
            self._block(node)
        elif kind == "declaration_command":
            flags = "".join(node_text(c)[1:] for c in node.named_children if node_text(c).startswith("-"))
            export = node.children[0].type == "export" or "x" in flags
            for child in node.named_children:
                if child.type == "variable_assignment":
                    self._assign(child, export)
                elif child.type == "variable_name" and export:
                    self.exported.add(node_text(child))
        elif kind == "command":
            self._command(node)
        elif kind == "redirected_statement" and (body := node.child_by_field_name("body")):
            self._stmt(body)
        elif kind == "function_definition" and (body := node.child_by_field_name("body")):
            self.functions[node_text(node.child_by_field_name("name"))] = (body, self.file)
        elif kind == "subshell":
            saved = dict(self.vars), set(self.exported), dict(self.taint), dict(self.uncertain), list(self.args)
            status = self._in_subshell(node)
            self.vars, self.exported, self.taint, self.uncertain, self.args = saved
            self._errexit(status, node)
        elif kind in _BLOCKS:
            self._conditional(node, _BLOCKS[kind])

    def _in_subshell(self, node: Node) -> int | None:
        """Run ``node`` as a subshell, where exit and return end the subshell only: the status they give, if any."""
        try:
            self._stmt(node) if node.type != "subshell" else self._block(node)
        except _Exit as exc:
            return exc.status
        return None

    def _errexit(self, status: int | None, node: Node) -> None:
        """``set -e`` ends the script when a subshell or pipeline fails, outside a condition."""
        if status and self.errexit and not self.conditions and not self.probing and not self.in_condition:
            raise _Exit(node_line(node), f"{_short(node_text(node))} (exit status {status} under set -e)", status)

    def _list(self, node: Node) -> None:
        """``a && b`` and ``a || b``: ``b`` runs or not by ``a``'s status, where preflight can tell it
        (verl_npu.preflight.flow); where it cannot, ``b`` is read as if it runs, but an exit or trainer in it is
        judged by the condition."""
        named = [c for c in node.named_children if c.type != "comment"]
        op = next((c for c in node.children if c.type in ("&&", "||")), None)
        if op is None or len(named) != 2:
            self._block(node)
            return
        left, right = named
        self.in_condition += 1  # set -e does not apply to the commands before && and ||
        try:
            self._stmt(left)
        finally:
            self.in_condition -= 1
        cond = self._probe(left, op.type == "&&")
        if decide([cond], "other")[0] == NO:  # bash does not run it (or, assumed, only when a command fails)
            self._conditional(right, f"a `{op.type}` list", (cond,), assigns=cond.assumed)
            return
        self.conditions.append(cond)
        try:
            self._stmt(right)
        finally:
            self.conditions.pop()

    def _probe(self, node: Node, need: bool) -> Cond:
        """``node``'s status as a condition, evaluated without side effects (``${X:=...}`` assigns nothing)."""
        was, self.probing = self.probing, True
        try:
            return self.status(node, need)
        finally:
            self.probing = was

    def _conditional(self, node: Node, block: str, outer: tuple[Cond, ...] = (), assigns: bool = True) -> None:
        """Evaluate nothing inside (no guessing), but remember what it may assign (``assigns``), and look for the
        commands that decide the launch: recognised ones, and exits (``exit``, ``return``, ``exec``)."""
        if assigns:
            assigned = (a for a in descendants(node, "variable_assignment") if a.parent.type != "command")
            names = [a.child_by_field_name("name") for a in assigned] + node.children_by_field_name("variable")
            for name in names:
                if name is not None and name.type == "variable_name":
                    self.uncertain[node_text(name)] = (node_line(name), block)
        self.probing = True
        try:
            for cmd in [node] if node.type == "command" else descendants(node, "command"):
                conds, isolated = self.path(cmd, node)
                if self.may_recognize(cmd):
                    conds = [*self.conditions, *outer, *conds]
                    self._command(cmd, block=Block(block, node_line(node), tuple(conds)))
                elif not isolated and (leaving := self._leaving(cmd)) is not None:
                    conds = [*outer, *conds]
                    self._leave(leaving, _short(node_text(cmd)), node_line(cmd), conds)
        finally:
            self.probing = False

    def _leaving(self, cmd: Node) -> str | None:
        """Which of exit/return/exec ``cmd`` is (exec only with a program to run), "function" for a call to a
        function that runs exit, or None."""
        name = cmd.child_by_field_name("name")
        word = node_text(name) if name is not None else ""
        args = [node_text(a) for a in cmd.children_by_field_name("argument")]
        if word in ("exit", "return") or (word == "exec" and any(not a.startswith("-") for a in args)):
            return word
        if word in self.functions:
            body = self.functions[word][0]
            if any(node_text(c.child_by_field_name("name") or c) == "exit" for c in descendants(body, "command")):
                return "function"
        return None

    def _leave(self, how: str, text: str, line: int, conds: list[Cond]) -> None:
        """An exit, return or exec (``how``) at ``line``: ends the script, function or file where the conditions
        hold, and is remembered as a possible end where preflight cannot tell (reported if a trainer follows)."""
        verdict, cond = decide([*self.conditions, *conds], "exit")
        in_function = bool(self.active) and isinstance(self.active[-1], str)
        if verdict == NO or (how == "return" and not in_function and len(self.active) <= 1 and not self.errexit):
            return  # not run; or a return at the script's top level, which bash refuses and goes on
        if verdict == UNKNOWN or how == "function":
            scope = "the function" if how == "return" and in_function else "the script"
            where = f"{self.file.name}: " if self.file != self.main else ""
            if cond is None:
                msg = f"{where}line {line}: `{text}` calls a function that may run exit"
            else:
                holds = "succeeds" if cond.need else "fails"
                why = f" ({cond.why})" if cond.why else ", a command that preflight does not run"
                msg = f"{where}line {line}: `{text}` ends {scope} when `{cond.text}` (line {cond.line}) {holds}"
                msg += f", which preflight cannot evaluate{why}"
            self.maybe_exits.append((line, msg, self._fails(how, text)))
            return
        code = text.split()[1] if how != "exec" and len(text.split()) > 1 else "0"
        status = int(code) & 255 if code.isascii() and code.isdigit() and len(code) < 10 else 1
        if how == "return" and (in_function or len(self.active) > 1):
            raise _Return(line, text, status)
        raise _Exit(line, text, status)

    def _fails(self, how: str, text: str) -> bool:
        """Whether this end is a guard: ``exit N`` with a literal N that is not 0 mod 256, or a call to a function
        whose every exit is one. A guard ends the job as a failure, so whichever way its condition goes the run
        is never mistaken for a trained one; ``exit 0``, a bare ``exit``, ``return`` or ``exec`` may end it silently."""

        def failing(words: Sequence[str]) -> bool:
            code = words[1] if len(words) == 2 else ""
            return code.isascii() and code.isdigit() and len(code) < 10 and int(code) & 255 != 0

        if how == "exit":
            return failing(text.split())
        if how == "function" and (name := text.split()[0] if text.split() else "") in self.functions:
            exits = [c for c in descendants(self.functions[name][0], "command")
                     if node_text(c.child_by_field_name("name") or c) == "exit"]  # fmt: skip
            return bool(exits) and all(failing(node_text(c).split()) for c in exits)
        return False

    def _assign(self, node: Node, export: bool = False) -> None:
        target, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        ctx, name, index = Taint(), node_text(target), None
        if target.type == "subscript":
            name = node_text(target.child_by_field_name("name"))
        try:
            val = self._value(value, ctx)
        except TooLarge:
            ctx = Taint()
            msg = f"could not evaluate ${name}: its value would be longer than {MAX_VALUE_CHARS} characters; "
            val = self.placeholder(f"${name}", ctx, msg + f"{self.TARGET} gets <${name}>", node_line(node))
        if target.type == "subscript":
            index = self._calc(target.child_by_field_name("index"), ctx)
            if index is None:  # only known when the script runs: the whole array is unknown from here
                ctx = Taint()
                msg = f"{_short(node_text(target))} has an index only known when the script runs; ${name} is unknown"
                self._set(name, self.placeholder(f"${name}", ctx, msg, node_line(node)), ctx, node_line(node))
                return
            items = self.vars.get(name)
            if index < 0:  # from the end, as bash counts it
                index += len(items) if isinstance(items, list) else (0 if items is None else 1)
                if index < 0:
                    msg = f"line {node_line(node)}: {_short(node_text(target))}: bad array subscript; bash assigns "
                    self.report("warning", "arith-error", node_line(node), msg + "nothing")
                    return
        old = self.vars.get(name)
        if index is not None or any(c.type == "+=" for c in node.children):
            ctx.merge(self.taint.get(name))
            items = old if isinstance(old, list) else ([] if old is None else [old])
            if index is not None:  # arrays are dense here: ARR[9]=x past the end appends, as "${ARR[@]}" shows it
                val = [*items[:index], scalar(val), *items[index + 1 :]]
            elif isinstance(val, list) or isinstance(old, list):
                val = [*items, *(val if isinstance(val, list) else [val])]
            else:
                val = (old or "") + val
        self._set(name, val, ctx, node_line(node))
        if export:
            self.exported.add(name)
        self._required(ctx)

    def _value(self, value: Node | None, ctx: Taint) -> str | list[str]:
        """An assignment's value: a string, or an array's words (raises TooLarge beyond MAX_VALUE_CHARS)."""
        if value is None:
            return ""
        if value.type == "array":
            elements = (self._fields(el, ctx) for el in value.named_children if el.type != "comment")
            return [re.sub(r"^\[[^]]*\]=", "", w) if i == 0 else w for ws in elements for i, w in enumerate(ws)]
        return join_pieces(self._tilde(self._pieces(value, ctx), ctx, node_line(value)))

    def _set(self, name: str, val: str | list[str], ctx: Taint, line: int | None = None) -> None:
        if self.probing:
            return
        if _size(val) > MAX_VALUE_CHARS or (isinstance(val, list) and len(val) > MAX_ARRAY_ITEMS):
            limits = f"more than {MAX_VALUE_CHARS} characters or {MAX_ARRAY_ITEMS} items"
            ctx = Taint()
            val = self.placeholder(f"${name}", ctx, f"could not evaluate ${name}: its value would hold {limits}; "
                                   f"{self.TARGET} gets <${name}>", line)  # fmt: skip
        self.vars[name], self.taint[name] = val, ctx
        self.uncertain.pop(name, None)
        if self.allexport:
            self.exported.add(name)

    def _required(self, ctx: Taint) -> None:
        for name, msg, line in ctx.required:
            text = f'{name} is not set, so bash stops at line {line} with "{msg}": set {name} before running the script'
            self.report("error", "required-variable", line, text)

    def _command(self, node: Node, block: tuple[str, int] | None = None) -> None:
        # The grammar glues `A=1 B=2`, a comment line and the next command into one node; a newline that is not a
        # line continuation ends a statement, so the assignments before it are plain assignments.
        kids, start, raw = node.named_children, 0, node.text or b""
        for i in range(1, len(kids)):
            gap = raw[kids[i - 1].end_byte - node.start_byte : kids[i].start_byte - node.start_byte]
            if kids[i - 1].type == "comment" or b"\n" in gap.replace(b"\\\n", b""):
                start = i
        name_node = node.child_by_field_name("name")
        prefix = [c for c in kids[start:] if c.type == "variable_assignment"]
        for a in [c for c in kids[:start] if c.type == "variable_assignment"] + (prefix if not name_node else []):
            if not self.probing:
                self._assign(a)
        if name_node is None:
            return
        ctx = Taint()
        words = self._word(name_node, ctx)
        # an unresolvable "$PYTHON" may well be the interpreter: judged by the -m that follows
        loose = b"$" in (name_node.text or b"") and bool(ctx.unknown or ctx.unset or ctx.required)
        words = words or ([f"<{node_text(name_node)}>"] if loose else [])
        groups: list[list[Node]] = []  # the grammar splits some words in two (k=a'b'\,): bash has no space there
        for arg in node.children_by_field_name("argument"):
            if groups and groups[-1][-1].end_byte == arg.start_byte:
                groups[-1].append(arg)
            else:
                groups.append([arg])
        words += [w for group in groups for w in self._word(group, ctx)]
        if self.recognize(node, words, loose, prefix, ctx, block):
            if words[:1] == ["exec"] and not self.probing:  # the script is replaced by the recognised command
                raise _Exit(node_line(node), _short(" ".join(words)))
            return
        if not self.probing:
            self._required(ctx)
            if words[:1] == ["let"]:
                for expression in words[1:] if not ctx.unknown else ():
                    self._eval_arith(expression, Taint(), node_line(node), stops=False)
            else:
                self._builtin(words, node_line(node))

    def _builtin(self, words: list[str], line: int) -> None:
        cmd, rest = (words[0], words[1:]) if words else ("", [])
        if cmd == "set":
            self._set_options(rest)
        elif cmd == "shift":
            count = int(rest[0]) if rest and rest[0].isdigit() and len(rest[0]) < 10 else 1 if not rest else None
            if count is not None and count <= len(self.args):  # bash refuses to shift past $# and changes nothing
                self.args = self.args[count:]
        elif cmd == "unset":
            for name in (w for w in rest if not w.startswith("-")):
                self.vars.pop(name, None)
                self.exported.discard(name)
        elif cmd in _DECLARE:  # only when the grammar took the builtin for a plain command
            for name, eq, value in (w.partition("=") for w in rest if not w.startswith("-")):
                if eq:
                    self._set(name, value, Taint())
                if cmd == "export":
                    self.exported.add(name)
        elif cmd in ("source", ".") and rest:
            self._source(rest[0], line)
        elif cmd in ("exit", "return") or (cmd == "exec" and any(not w.startswith("-") for w in rest)):
            self._leave(cmd, _short(" ".join(words)), line, [])
        elif cmd in self.functions and cmd not in self.active:
            body, where = self.functions[cmd]
            saved, self.args, outer, self.file = self.args, rest, self.file, where
            self.active.append(cmd)
            try:
                self._block(body)
            except _Return:
                pass
            finally:
                self.args, self.file = saved, outer
                self.active.pop()

    def _set_options(self, rest: list[str]) -> None:
        """``set -u``, ``-a``, ``-e`` and ``-o pipefail`` (and their ``+`` forms): what the evaluation follows."""
        for i, flag in enumerate(rest):
            letters = flag[1:] if re.fullmatch(r"[-+][a-zA-Z]+", flag) else ""
            opt = rest[i + 1] if letters.endswith("o") and i + 1 < len(rest) else ""
            on = flag[0] == "-"
            if "u" in letters or opt == "nounset":
                self.nounset = on
            if "a" in letters or opt == "allexport":
                self.allexport = on
            if "e" in letters or opt == "errexit":
                self.errexit = on
            if opt == "pipefail":
                self.pipefail = on

    def _source(self, word: str, line: int) -> None:
        path = Path(word.replace("\0", "?"))  # a NUL cannot name a file: read_script_file refuses the real word
        if not path.is_absolute():  # relative to the script, never to preflight's own working directory
            dirs = (self.file.parent, self.main.parent)
            path = next((d / path for d in dirs if _is_file(d / path)), self.file.parent / path)
        if _resolved(path) in self.active:
            return
        left = MAX_SOURCED_BYTES - self.sourced_bytes
        try:
            if left <= 0:
                raise ScriptFileError(f"the files sourced before it already hold {MAX_SOURCED_BYTES >> 20} MiB")
            data = read_script_file(Path(word) if "\0" in word else path, min(left, MAX_SCRIPT_BYTES))
        except ScriptFileError as exc:
            msg = f"`source {word}`: {path} is not read here ({exc}), so the variables it sets are unknown to "
            msg += "preflight"
            self.report("warning", "unresolved", line, msg)
            return
        self.sourced_bytes += len(data)
        self.run_file(path, data)

    # words

    def _fields(self, node: Node | list[Node], ctx: Taint) -> list[str]:
        """A word's fields: brace expansion (on the word's literal text), then ~, then word splitting."""
        nodes = node if isinstance(node, list) else [node]
        line, pieces = node_line(nodes[0]), [p for n in nodes for p in self._pieces(n, ctx)]
        try:
            words = braces.expand(pieces, MAX_ARRAY_ITEMS)
        except braces.TooMany:
            raise TooLarge from None
        except braces.Unclear:
            text = _short("".join(map(node_text, nodes)))
            msg = f"line {line}: preflight cannot tell how bash expands the braces of `{text}` (an empty {{}} next to "
            self.report("error", "braces-unclear", line, msg + "other braces); quote the braces that are text")
            words = [pieces]
        if len(words) == 1:
            return _fields(self._tilde(words[0], ctx, line))
        text = "".join(map(node_text, nodes))
        if re.search(r"(?<!\\)\$[A-Za-z_]\w*\{", text):  # bash expands $A{1,2} to $A1 $A2: other variables
            msg = f"{_short(text)}: brace expansion makes new variable names of it; {self.TARGET} gets <{_short(text)}>"
            return [self.placeholder(text, ctx, msg, line)]
        fields = [f for w in words for f in _fields(self._tilde(w, ctx, line))]
        ctx.braced[(line, text)] = tuple(fields)
        return fields

    # what preflight.flow asks to evaluate a condition

    def _cond_word(self, node: Node, split: bool) -> list[str] | tuple[str, str]:
        """A word in a condition: its fields (``split``) or (its text, it as a pattern); raises Unknown."""
        ctx = Taint()
        was, self.probing = self.probing, True
        try:
            pieces = self._pieces(node, ctx)
            value = _fields(pieces) if split else (join_pieces(pieces), _pattern(pieces))
        except TooLarge:
            raise Unknown("a value in it is too long to evaluate") from None
        finally:
            self.probing = was
        self._known(ctx, value)
        return value

    def _known(self, ctx: Taint, value: object) -> None:
        """Raise Unknown, saying why, where ``ctx`` or ``value`` holds what only running the script would tell."""
        if ctx.unset:
            name = next(iter(ctx.unset))[0]
            raise Unknown(f"${name} is not set here: give its value with --env {name}=VALUE")
        if ctx.uncertain:
            name, line, where = next(iter(ctx.uncertain))
            raise Unknown(f"${name} is assigned inside {where} (line {line}), which preflight does not evaluate")
        if ctx.unknown or ctx.required or self._holds_placeholder(list(value) if isinstance(value, tuple) else value):
            raise Unknown(next(iter(ctx.unknown), "it holds a value only running the script would tell"))

    def _cond_arith(self, node: Node, lo: int, hi: int) -> int:
        ctx = Taint()
        was, self.probing = self.probing, True
        try:
            value = self._calc(node, ctx, lo, hi, stops=False)
        except _Abandoned:
            raise Unknown("its arithmetic fails") from None
        finally:
            self.probing = was
        self._known(ctx, "")
        if value is None:
            raise Unknown("its arithmetic cannot be computed statically")
        return value

    def _is_set(self, name: str) -> bool:
        if name in self.uncertain:
            raise Unknown(f"${name} is assigned inside a block preflight does not evaluate")
        return name in self.vars

    def _positional(self) -> list[str]:
        return list(self.args)

    def _word(self, node: Node | list[Node], ctx: Taint) -> list[str]:
        """A command word's fields; one placeholder for a word that would be longer than MAX_VALUE_CHARS."""
        try:
            return self._fields(node, ctx)
        except TooLarge:
            nodes = node if isinstance(node, list) else [node]
            text = "".join(map(node_text, nodes))
            msg = f"could not evaluate {_short(text)}: it expands to more than {MAX_VALUE_CHARS} characters; "
            return [self.placeholder(text, ctx, msg + f"{self.TARGET} gets <{_short(text)}>", node_line(nodes[0]))]

    def _tilde(self, pieces: Pieces, ctx: Taint, line: int) -> Pieces:
        """~ and ~/x, also after NAME= as bash does (but not after data.path=, which is no assignment)."""
        if pieces and pieces[0][0] == LIT and (m := re.match(r"(?:[A-Za-z_]\w*=)?~(?=/|$)", pieces[0][1])):
            home = scalar(self._var("HOME", ctx, line) or "~")
            pieces[0] = (LIT, m[0][:-1] + home + pieces[0][1][m.end() :])
        return pieces

    def _pieces(self, node: Node, ctx: Taint, quoted: bool = False, lit: str = LIT) -> Pieces:
        kind, text = node.type, node_text(node)
        if kind == "string":
            end = node.end_byte - text.endswith('"')
            pieces = self._span(node, ctx, node.start_byte + 1, end, node.named_children, True, lit)
            return pieces if pieces or node.named_children else [(QUOTED, "")]  # "$@" without args is no word
        if kind == "raw_string":
            return [(QUOTED, text[1:-1])]
        if kind == "ansi_c_string":
            return [(QUOTED, re.sub(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)", _ansi, text[2:-1], flags=re.S))]
        if kind == "translated_string" and node.named_children:
            return self._pieces(node.named_children[-1], ctx, quoted, lit)
        if kind in ("concatenation", "command_name"):
            return self._span(node, ctx, node.start_byte, node.end_byte, node.named_children, quoted, lit)
        if kind in ("simple_expansion", "expansion"):
            return self._expand(node, ctx, quoted)
        if kind == "arithmetic_expansion":
            kids, known = node.children, len(ctx.unknown)
            if len(kids) >= 2 and (value := self._calc(node, ctx, kids[0].end_byte, kids[-1].start_byte)) is not None:
                return [(QUOTED, str(value))]
            if len(ctx.unknown) > known:  # _calc said why (a bound, an unknown variable)
                self.placeholders[f"<{text}>"] = None
                return [(QUOTED, f"<{text}>")]
            msg = f"{_short(text)} cannot be computed statically; {self.TARGET} gets <{_short(text)}>"
            return [(QUOTED, self.placeholder(text, ctx, msg, node_line(node)))]
        if kind in ("command_substitution", "process_substitution"):
            inner = re.sub(r"[\"']", "", text[2:-1] if text.startswith("$(") else text[1:-1]).strip()
            if m := _SELF_DIR.fullmatch(inner):
                return [(QUOTED, str((self.main if m[1] == "0" else self.file).absolute().parent))]
            msg = f"{_short(text)} is a command's output, which preflight does not run; {self.TARGET} gets "
            msg += f"<{_short(text)}>"
            return [(QUOTED, self.placeholder(text, ctx, msg, node_line(node)))]
        return [(QUOTED, _unescape(text, True))] if quoted else _unquoted(text, lit)

    def _span(self, node: Node, ctx: Taint, lo: int, hi: int, kids, quoted: bool, lit: str) -> Pieces:
        """Pieces of the kids within [lo, hi); text the grammar left between them is literal."""
        out: Pieces = []
        pos, raw = lo, node.text or b""

        def gap(a: int, b: int) -> None:
            if b > a:
                s = raw[a - node.start_byte : b - node.start_byte].decode(errors="replace")
                out.extend([(QUOTED, _unescape(s, True))] if quoted else _unquoted(s, lit))

        for kid in kids:
            if kid.start_byte >= lo and kid.end_byte <= hi:
                gap(pos, kid.start_byte)
                out.extend(self._pieces(kid, ctx, quoted, lit))
                pos = kid.end_byte
        gap(pos, hi)
        return out

    def _var(self, name: str, ctx: Taint, line: int) -> str | list[str] | None:
        ctx.merge(self.taint.get(name))
        if name in self.uncertain:
            ctx.uncertain[(name, *self.uncertain[name])] = None
        if name == "BASH_SOURCE" and name not in self.vars:
            return [str(self.file.absolute())]
        if name not in self.vars and _SHELL_PROVIDED.fullmatch(name):
            msg = f"${name} belongs to the machine that runs the script; pass it in env to resolve it"
            return self.placeholder(f"${name}", ctx, msg, line)
        if name not in self.vars and name in self.uncertain:
            # assigned only inside a block preflight does not evaluate (a loop, an if): unknown, not unset
            marker = f"<${name}>"
            self.placeholders[marker] = None
            return marker
        return self.vars.get(name)

    def _expand(self, node: Node, ctx: Taint, quoted: bool) -> Pieces:
        """$NAME and ${...}: the value, its length (${#...}), a default (${x:-...}) or a transformation."""
        kids = [c for c in node.children if c.type not in ("$", "${", "}")]
        hi = node.children[-1].start_byte if node.children[-1].type == "}" else node.end_byte
        prefix = kids.pop(0).type if len(kids) > 1 and kids[0].type in ("#", "!") else None
        if not kids:
            return [(LIT, node_text(node))]
        line = node_line(node)
        name, val, star = self._lookup(kids[0], ctx, line)
        if prefix == "!" and isinstance(val, str):
            name, val = val, self._var(val, ctx, line)
        p = _Param(node, kids[1:], hi, name, val, star, quoted, line)
        if prefix == "#":
            if val is None:
                ctx.unset[(name, line, self.nounset)] = None
            return [(QUOTED, str(len(val or "")))]
        op = p.rest[0].type if p.rest else None
        if op in _DEFAULT_OPS:
            return self._defaulted(p, op, ctx)
        if val is None:
            ctx.unset[(name, line, self.nounset)] = None
            p = replace(p, val="")
        if op is None:
            return self._out(p.val, quoted, star)
        return self._transform(p, op, ctx)

    def _lookup(self, target: Node, ctx: Taint, line: int) -> tuple[str, str | list[str] | None, bool]:
        """(name, value, whether it is $* / ${A[*]}) of an expansion's parameter."""
        name = node_text(target)
        if target.type == "subscript":
            name, index = node_text(target.child_by_field_name("name")), target.child_by_field_name("index")
            arr = self._var(name, ctx, line)
            items = arr if isinstance(arr, list) else ([] if arr is None else [arr])
            if node_text(index) in ("@", "*"):
                return name, list(items), node_text(index) == "*"
            i = self._calc(index, ctx)
            if i is None:  # the index is only known when the script runs (or past a bound): so is the element
                text = f"${{{node_text(target)}}}"
                msg = f"{_short(text)}: its index is not known statically; {self.TARGET} gets <{_short(text)}>"
                return name, self.placeholder(text, ctx, msg, line), False
            return name, items[i] if -len(items) <= i < len(items) else None, False
        if name in ("@", "*"):
            ctx.passthrough = True
            return name, list(self.args), name == "*"
        if name == "#":
            return name, str(len(self.args)), False
        if name.isdigit():
            if name == "0":
                return name, str(self.main.absolute()), False
            number = int(name) if len(name) <= 9 else None  # ${99999...}: far past any argument
            return name, self.args[number - 1] if number is not None and 1 <= number <= len(self.args) else None, False
        if target.type == "special_variable_name":
            return name, self.placeholder(f"${name}", ctx, f"${name} is only known while the script runs", line), False
        val = self._var(name, ctx, line)
        if isinstance(val, list):  # $ARR is its first element
            val = val[0] if val else None
        return name, val, False

    def _operand(self, p: _Param, ctx: Taint, quoted: bool, lo: int = 0, end: int = 0) -> Pieces:
        """The word after the operator (from ``lo`` to ``end`` when given)."""
        return self._span(p.node, ctx, lo or p.rest[0].end_byte, end or p.hi, p.rest[1:], quoted, UNQUOTED)

    def _defaulted(self, p: _Param, op: str, ctx: Taint) -> Pieces:
        """${x:-w} ${x-w} ${x:=w} ${x=w} ${x:?w} ${x?w} ${x:+w} ${x+w}."""
        missing = p.val is None or (op[0] == ":" and not p.val)
        if op in (":+", "+") and not missing:
            return self._operand(p, ctx, p.quoted)
        if op in (":+", "+", ":?", "?") or not missing:
            if missing and "?" in op:
                message = join_pieces(self._operand(p, ctx, True)) or "parameter null or not set"
                ctx.required.append((p.name, message, p.line))
            if not missing:
                return self._out(p.val, p.quoted, p.star)
            return [(QUOTED, "")] if p.quoted else []
        sub = Taint()
        pieces = self._operand(p, sub, p.quoted)
        ctx.merge(sub)
        if "=" in op:
            self._set(p.name, join_pieces(pieces), sub)
        return pieces

    def _transform(self, p: _Param, op: str, ctx: Taint) -> Pieces:
        """${x#w} ${x%w} ${x/a/b} ${x,,} ${x^^} ${x:start:length}, on each element of an array value."""
        val, rest = p.val, p.rest
        values, apply = (val if isinstance(val, list) else [val]), None
        if op in ("#", "##", "%", "%%"):
            work = sum(len(v) * (len(v) + 1) // 2 for v in values)  # every cut of each value is tried
            if self.trim_work + work <= MAX_TRIM_WORK:
                self.trim_work += work
                apply = functools.partial(_trim, op=op, pattern=_pattern(self._operand(p, ctx, False)))
        elif op in ("/", "//"):
            cut = next((k for k in rest[1:] if k.type == "/"), None)  # none: ${x/pattern} deletes the match
            pieces = self._operand(p, ctx, False, end=cut.start_byte if cut else 0)
            find = join_pieces(pieces)
            repl = join_pieces(self._operand(p, ctx, True, lo=cut.end_byte)) if cut else ""
            glob = any(kind != QUOTED and re.search(r"[*?\[]", text) for kind, text in pieces)
            grows = sum(v.count(find) for v in values) * max(len(repl) - len(find), 0) if find else 0
            if not find:  # bash replaces nothing for an empty pattern
                apply = str
            elif not glob and sum(map(len, values)) + grows <= MAX_VALUE_CHARS:
                apply = lambda v: v.replace(find, repl, -1 if op == "//" else 1)  # noqa: E731
        elif op in (",,", "^^"):
            apply = str.lower if op == ",," else str.upper
        elif op == ":" and (numbers := [self._calc(k, ctx) for k in rest[1:] if k.type != ":"]) and None not in numbers:
            length = numbers[1] if len(numbers) > 1 else None
            if isinstance(val, list):
                items = [str(self.main.absolute()), *values] if p.name == "@" else values  # ${@:0} is $0
                return self._out(self._slice_items(items, numbers[0], length, p), p.quoted, p.star)
            apply = functools.partial(self._slice_text, start=numbers[0], length=length, p=p)
        if apply is None:
            text = node_text(p.node)
            msg = f"{_short(text)} is not understood by preflight; {self.TARGET} gets <{_short(text)}>"
            return [(QUOTED, self.placeholder(text, ctx, msg, p.line))]
        mapped = [apply(v) for v in values]
        return self._out(mapped if isinstance(val, list) else mapped[0], p.quoted, p.star)

    def _substring_error(self, p: _Param, length: int) -> None:
        msg = f"line {p.line}: {length}: substring expression < 0: bash abandons the command there"
        self.report("error", "arith-error", p.line, msg)
        raise _Abandoned

    def _slice_text(self, v: str, start: int, length: int | None, p: _Param) -> str:
        """${x:start:length} as bash takes it: negative start and length count from the end."""
        n = len(v)
        off = start if start >= 0 else n + start
        if off < 0 or off > n:
            return ""
        if length is None:
            return v[off:]
        end = off + length if length >= 0 else n + length
        if end < off:
            self._substring_error(p, length)
        return v[off:end]

    def _slice_items(self, items: list[str], start: int, length: int | None, p: _Param) -> list[str]:
        """${A[@]:start:length} and ${@:start:length}: a negative start counts from the end; a negative length fails."""
        n = len(items)
        off = start if start >= 0 else n + start  # for $@ items[0] is $0, so ${@: -1} is the last argument
        if off < 0:
            return []
        if length is not None and length < 0:
            self._substring_error(p, length)
        return items[off : None if length is None else off + length]

    @staticmethod
    def _out(val: str | list[str], quoted: bool, star: bool) -> Pieces:
        kind = QUOTED if quoted else UNQUOTED
        if not isinstance(val, list):
            return [(kind, val)]
        if quoted and star:
            return [(QUOTED, " ".join(val))]
        return [p for i, v in enumerate(val) for p in ([(BREAK, "")] if i else []) + [(kind, v)]]

    def _calc(
        self, node: Node | None, ctx: Taint, lo: int | None = None, hi: int | None = None, stops: bool = True
    ) -> int | None:
        """Bash arithmetic on ``node``'s text (bytes ``lo``..``hi`` of it), its expansions done first; None: unknown.

        ``stops``: bash stops the script when it fails (an expansion: ``$((...))``, a subscript, an offset), rather
        than returning status 1 (``((...))`` and ``let``).
        """
        if node is None:
            return None
        sub = Taint()
        text = self._arith_text(node, sub, node.start_byte if lo is None else lo, node.end_byte if hi is None else hi)
        ctx.merge(sub)
        if sub.unknown or self._holds_placeholder(text):
            return None
        return self._eval_arith(text, ctx, node_line(node), stops)

    def _arith_text(self, node: Node, ctx: Taint, lo: int, hi: int) -> str:
        """The expression as bash evaluates it: parameter expansions and substitutions in it replaced by their text."""
        raw, base = node.text or b"", node.start_byte
        out: list[str] = []
        pos = lo
        stack = [node]  # document order, iteratively: 1+1+...+1 nests as deep as it is long
        while stack:
            kid = stack.pop()
            if kid.end_byte <= lo or kid.start_byte >= hi:
                continue
            if kid.type in _ARITH_EXPANSIONS and kid.start_byte >= lo and kid.end_byte <= hi:
                out.append(raw[pos - base : kid.start_byte - base].decode(errors="replace"))
                out.append(join_pieces(self._pieces(kid, ctx)))
                pos = kid.end_byte
            else:
                stack.extend(reversed(kid.children))
        out.append(raw[pos - base : hi - base].decode(errors="replace"))
        return "".join(out)

    def _eval_arith(self, text: str, ctx: Taint, line: int, stops: bool = True) -> int | None:
        """``text`` evaluated as bash arithmetic (verl_npu.preflight.arith); None when it cannot be known here."""
        sub = Taint()

        def lookup(name: str, index: int | None) -> str | None:
            value = self._var(name, sub, line)
            if sub.unknown or self._holds_placeholder(value):  # a value only running the script would tell
                raise _Unknown
            if value is None:
                sub.unset[(name, line, self.nounset)] = None
                return None
            items = value if isinstance(value, list) else [value]
            i = 0 if index is None else index + len(items) if index < 0 else index
            return items[i] if 0 <= i < len(items) else None

        def store(name: str, index: int | None, value: int) -> None:
            if index is None:
                self._set(name, str(value), Taint(), line)
                return
            old = self.vars.get(name)
            items = old if isinstance(old, list) else ([] if old is None else [old])
            index = index + len(items) if index < 0 else index
            if index < 0:
                raise ArithError(f"{name}[{index - len(items)}]: bad array subscript")
            self._set(name, [*items[:index], str(value), *items[index + 1 :]], Taint(), line)

        try:
            return Arith(lookup, store)(text)
        except _Unknown:
            return None
        except Limit as exc:
            msg = f"could not evaluate $(( {_short(text.strip())} )): {exc}; {self.TARGET} gets a placeholder"
            ctx.unknown[msg] = line
            return None
        except ArithError as exc:
            if not stops:
                self.report("warning", "arith-error", line, f"line {line}: {exc}: the command fails (status 1)")
                return None
            msg = f"line {line}: {exc}: bash abandons the command there, with the rest of its top-level command "
            msg += "(the line, or the function call it is in); even under set -e the script goes on after it"
            self.report("error", "arith-error", line, msg)
            raise _Abandoned from None
        finally:
            ctx.merge(sub)
