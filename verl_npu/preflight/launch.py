"""Recover the verl trainer invocation from a bash launch script without running it.

The script is parsed with tree-sitter's bash grammar and evaluated statically, in statement order: assignments,
exports, parameter expansions, arithmetic, arrays, ``source`` and functions called at top level. The result is the
Hydra override list exactly as ``python -m verl.trainer.main_ppo`` would receive it, the environment it would see,
and findings for launch bugs (extra arguments piped into ``tee``, unset variables, syntax errors).

Static on purpose: a launch script may start Ray, write files or submit jobs, and preflight must be safe to run
anywhere, including on a laptop with none of the cluster's paths. What only running a command would tell (``$(...)``,
values assigned under ``if`` or in loops) is kept as a visible placeholder such as ``<$(uname -m)>`` and reported.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

TRAINER_MODULE = "verl.trainer.main_ppo"
_PYTHON = re.compile(r"(?:.*/)?python(?:\d+(?:\.\d+)?)?")
_NAME = re.compile(r"[A-Za-z_]\w*")
# $(dirname "$0") and $(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) name the script's own folder: known statically.
_SELF_DIR = re.compile(r"(?:cd\s+\$\()?dirname\s+\$\{?(0|BASH_SOURCE(?:\[0\])?)\}?\)?(?:\s*(?:&&|;)\s*pwd(?:\s+-P)?)?")
# Set by bash itself, so never unset, but their values belong to the machine that runs the script.
_SHELL_PROVIDED = re.compile(r"PWD|OLDPWD|HOME|USER|HOSTNAME|UID|EUID|RANDOM|SECONDS|PPID|BASHPID|SHELL|PATH")
# IFS whitespace, except inside a <$(...)> placeholder, which stands for one unknown value.
_SPLIT = re.compile(r"[ \t\n]+(?=[^<>]*(?:<|$))")
_ANSI = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "v": "\v"}
_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "**": operator.pow, "<<": operator.lshift}
_ARITH |= {">>": operator.rshift, "&": operator.and_, "|": operator.or_, "^": operator.xor}
_BLOCKS = {"if_statement": "an if block", "case_statement": "a case block", "while_statement": "a while/until loop"}
_BLOCKS |= {"for_statement": "a for loop", "c_style_for_statement": "a for loop"}
_CHAIN = {"pipeline", "list", "redirected_statement", "negated_command"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}
LIT, QUOTED, UNQUOTED, BREAK = "lit", "quoted", "unquoted", "break"  # kinds of word pieces, see _fields
Pieces = list[tuple[str, str]]


class LaunchError(ValueError):
    """The launch script cannot be read."""


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    code: str  # args-to-tee, unset-variable, required-variable, no-trainer, multiple-trainers, unparsed, unresolved
    message: str
    line: int | None


@dataclass(frozen=True)
class Launch:
    source: str  # script path or "<overrides>"
    module: str | None  # TRAINER_MODULE, or None when no command runs it
    config_name: str | None  # --config-name, None when absent
    overrides: tuple[str, ...]  # as the trainer receives them, without --config-name
    passthrough: tuple[str, ...]  # what "$@"/"$*" stood for; already inside overrides
    env: dict[str, str]  # the trainer's environment: the given env, exports (also `set -a`), NAME=value prefixes
    variables: dict[str, str]  # every shell variable at the trainer command (arrays joined by spaces)
    findings: tuple[Finding, ...]
    trainer_line: int | None


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


class _Taint:
    """What a value depends on that must be reported if the value reaches the trainer; variables carry theirs."""

    def __init__(self) -> None:
        self.unknown: dict[str, int] = {}  # message -> line
        self.unset: dict[tuple[str, int, bool], None] = {}  # (name, line, under set -u)
        self.uncertain: dict[tuple[str, int, str], None] = {}  # (name, line, block)
        self.required: list[tuple[str, str, int]] = []  # ${X:?msg} that fired: (name, msg, line)
        self.passthrough = False

    def merge(self, other: _Taint | None) -> None:
        if other is not None:
            self.unknown |= other.unknown
            self.unset |= other.unset
            self.uncertain |= other.uncertain
            self.passthrough |= other.passthrough


@functools.cache
def _parser() -> Parser:
    return Parser(Language(tree_sitter_bash.language()))


def _line(node: Node) -> int:
    return node.start_point.row + 1


def _text(node: Node) -> str:
    return (node.text or b"").decode()


def _unescape(s: str, quoted: bool) -> str:
    pattern = r'\\([$`"\\\n])' if quoted else r"\\(.)"
    return re.sub(pattern, lambda m: "" if m[1] == "\n" else m[1], s, flags=re.S)


def _ansi(m: re.Match) -> str:
    code = m[1]
    return (
        chr(int(code[1:], 16) if code[0] == "x" else int(code, 8)) if code[0] in "x01234567" else _ANSI.get(code, code)
    )


def _fields(pieces: Pieces) -> list[str]:
    """Bash word splitting: only unquoted expansions split, and a quoted empty string is still a word."""
    out: list[str] = []
    cur, have = "", False
    for kind, text in pieces:
        if kind == UNQUOTED:
            for i, part in enumerate(_SPLIT.split(text)):
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


def _join(pieces: Pieces) -> str:
    """An assignment's value: no word splitting, "$@" joined by spaces."""
    return "".join(" " if kind == BREAK else text for kind, text in pieces)


def _scalar(value: str | list[str]) -> str:
    return " ".join(value) if isinstance(value, list) else value


def _int(text: str) -> int:
    text = text.strip()
    if "#" in text:
        base, digits = text.split("#", 1)
        return int(digits, int(base))
    return int(text, 8) if re.fullmatch(r"0[0-7]+", text) else int(text, 0) if text else 0


def _trim(value: str, op: str, pattern: str) -> str:
    cuts = range(len(value) + 1)
    for i in cuts if op in ("#", "%%") else reversed(cuts):
        if op[0] == "#" and fnmatchcase(value[:i], pattern):
            return value[i:]
        if op[0] == "%" and fnmatchcase(value[i:], pattern):
            return value[:i]
    return value


def _descendants(node: Node, kind: str) -> Iterator[Node]:
    for child in node.named_children:
        if child.type == kind:
            yield child
        if child.type not in ("command_substitution", "process_substitution"):
            yield from _descendants(child, kind)


def _split_config(words: Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
    """Hydra takes the last --config-name/-cn; every other word is an override."""
    config, rest, it = None, [], iter(words)
    for word in it:
        flag, eq, value = word.partition("=")
        if flag in ("--config-name", "-cn"):
            config = value if eq else next(it, None)
        else:
            rest.append(word)
    return config, tuple(rest)


class _Shell:
    def __init__(self, path: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
        self.main = self.file = path
        self.vars: dict[str, str | list[str]] = dict(env)
        self.exported = set(env)
        self.taint: dict[str, _Taint] = {}
        self.uncertain: dict[str, tuple[int, str]] = {}  # assigned in an unevaluated block: (line, block)
        self.args = list(args)
        self.nounset = self.allexport = self.probing = False
        self.functions: dict[str, tuple[Node, Path]] = {}
        self.active: list[object] = []  # files being sourced and functions running: recursion guard
        self.findings: list[Finding] = []
        self.trainers: list[Launch] = []

    def report(self, severity: str, code: str, line: int | None, message: str) -> None:
        if self.file != self.main:
            message = f"{self.file.name}: {message}"
        self.findings.append(Finding(severity, code, message, line))

    # statements

    def run_file(self, path: Path, data: bytes) -> None:
        tree = _parser().parse(data)
        outer, self.file = self.file, path
        self.active.append(path.resolve())
        try:
            for bad in self._errors(tree.root_node) if tree.root_node.has_error else ():
                msg = f"line {_line(bad)} is not valid bash (near {_text(bad).split(chr(10))[0][:40]!r}); the trainer "
                self.report("error", "unparsed", _line(bad), msg + "command may be misread: check it with `bash -n`")
            self._block(tree.root_node)
        finally:
            self.file = outer
            self.active.pop()

    def _errors(self, node: Node) -> Iterator[Node]:
        if node.is_missing:
            yield node
        elif node.type == "ERROR":
            # tree-sitter wraps the valid statements before a syntax error into the ERROR node too
            ok = {"command", "comment", "variable_assignment", "declaration_command", *_CHAIN, *_BLOCKS}
            yield next((c for c in node.children if c.type not in ok), node)
        else:
            for child in node.children:
                if child.has_error or child.is_missing:
                    yield from self._errors(child)

    def _block(self, node: Node) -> None:
        for child in node.named_children:
            self._stmt(child)

    def _stmt(self, node: Node) -> None:
        kind = node.type
        if kind == "variable_assignment":
            self._assign(node)
        elif kind in ("variable_assignments", "pipeline", "list", "negated_command", "compound_statement", "ERROR"):
            self._block(node)
        elif kind == "declaration_command":
            flags = "".join(_text(c)[1:] for c in node.named_children if _text(c).startswith("-"))
            export = node.children[0].type == "export" or "x" in flags
            for child in node.named_children:
                if child.type == "variable_assignment":
                    self._assign(child, export)
                elif child.type == "variable_name" and export:
                    self.exported.add(_text(child))
        elif kind == "command":
            self._command(node)
        elif kind == "redirected_statement" and (body := node.child_by_field_name("body")):
            self._stmt(body)
        elif kind == "function_definition" and (body := node.child_by_field_name("body")):
            self.functions[_text(node.child_by_field_name("name"))] = (body, self.file)
        elif kind == "subshell":
            saved = dict(self.vars), set(self.exported), dict(self.taint), dict(self.uncertain), list(self.args)
            self._block(node)
            self.vars, self.exported, self.taint, self.uncertain, self.args = saved
        elif kind in _BLOCKS:
            self._conditional(node, _BLOCKS[kind])

    def _conditional(self, node: Node, block: str) -> None:
        """Evaluate nothing inside (no guessing), but remember what it may assign and look for the trainer in it."""
        assigned = (a for a in _descendants(node, "variable_assignment") if a.parent.type != "command")
        names = [a.child_by_field_name("name") for a in assigned] + node.children_by_field_name("variable")
        for name in names:
            if name is not None and name.type == "variable_name":
                self.uncertain[_text(name)] = (_line(name), block)
        self.probing = True
        try:
            for cmd in _descendants(node, "command"):
                if b"-m" in (cmd.text or b""):
                    self._command(cmd, block=(block, _line(node)))
        finally:
            self.probing = False

    def _assign(self, node: Node, export: bool = False) -> None:
        target, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        ctx, name, index = _Taint(), _text(target), None
        if value is None:
            val: str | list[str] = ""
        elif value.type == "array":
            elements = (self._fields(el, ctx) for el in value.named_children if el.type != "comment")
            val = [re.sub(r"^\[[^]]*\]=", "", w) if i == 0 else w for ws in elements for i, w in enumerate(ws)]
        else:
            val = _join(self._tilde(self._pieces(value, ctx), ctx, _line(value)))
        if target.type == "subscript":
            name = _text(target.child_by_field_name("name"))
            index = self._calc(target.child_by_field_name("index"), ctx) or 0
        old = self.vars.get(name)
        if index is not None or any(c.type == "+=" for c in node.children):
            ctx.merge(self.taint.get(name))
            items = old if isinstance(old, list) else ([] if old is None else [old])
            if index is not None:  # arrays are dense here: ARR[9]=x past the end appends, as "${ARR[@]}" shows it
                val = [*items[:index], _scalar(val), *items[index + 1 :]]
            elif isinstance(val, list) or isinstance(old, list):
                val = [*items, *(val if isinstance(val, list) else [val])]
            else:
                val = (old or "") + val
        self._set(name, val, ctx)
        if export:
            self.exported.add(name)
        self._required(ctx)

    def _set(self, name: str, val: str | list[str], ctx: _Taint) -> None:
        if not self.probing:
            self.vars[name], self.taint[name] = val, ctx
            self.uncertain.pop(name, None)
            if self.allexport:
                self.exported.add(name)

    def _required(self, ctx: _Taint) -> None:
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
        ctx = _Taint()
        words = self._fields(name_node, ctx)
        # an unresolvable "$PYTHON" may well be the interpreter: judged by the -m that follows
        loose = b"$" in (name_node.text or b"") and bool(ctx.unknown or ctx.unset or ctx.required)
        words = words or ([f"<{_text(name_node)}>"] if loose else [])
        words += [w for arg in node.children_by_field_name("argument") for w in self._fields(arg, ctx)]
        if (found := self._match(words, loose)) is not None:
            self._trainer(node, words, found, prefix, ctx, block)
        elif not self.probing:
            self._required(ctx)
            self._builtin(words, _line(node))

    @staticmethod
    def _match(words: list[str], loose: bool) -> tuple[int, int] | None:
        """(index of the interpreter, index of the first trainer argument), or None."""
        for i, word in enumerate(words if words[:1] not in (["echo"], ["printf"]) else ()):
            if not (_PYTHON.fullmatch(word) or (loose and i == 0)):
                continue
            j = i + 1
            while j < len(words) and words[j].startswith("-") and not words[j].startswith(("-m", "-c")):
                j += 1  # interpreter flags such as -u
            if words[j : j + 2] == ["-m", TRAINER_MODULE]:
                return i, j + 2
            if words[j : j + 1] == ["-m" + TRAINER_MODULE]:
                return i, j + 1
        return None

    def _trainer(self, node: Node, words: list[str], found, prefix: list[Node], ctx: _Taint, block) -> None:
        env = {n: _scalar(v) for n, v in self.vars.items() if n in self.exported}
        for a in prefix:
            value = a.child_by_field_name("value")
            env[_text(a.child_by_field_name("name"))] = _join(self._pieces(value, ctx)) if value else ""
        if words[0] == "env":  # env A=1 python -m ...
            env |= dict(w.split("=", 1) for w in words[1 : found[0]] if _NAME.match(w) and "=" in w)
        config, overrides = _split_config(words[found[1] :])
        passthrough, line = tuple(self.args) if ctx.passthrough else (), _line(node)
        variables = {k: _scalar(v) for k, v in self.vars.items()}
        self.trainers.append(Launch("", TRAINER_MODULE, config, overrides, passthrough, env, variables, (), line))
        self._required(ctx)
        for msg, at in ctx.unknown.items():
            self.report("warning", "unresolved", at, msg)
        for name, at, strict in ctx.unset:
            msg = f"positional argument ${name} is not given" if name.isdigit() else f"{name} is never set"
            msg += f" but is used without a default at line {at} ("
            msg += "set -u makes bash stop there" if strict else "it expands to nothing"
            msg += f"); write ${{{name}:-default}} or export {name} before running"
            self.report("error" if strict else "warning", "unset-variable", at, msg)
        for name, at, where in ctx.uncertain:
            msg = f"{name} is assigned inside {where} (line {at}), which preflight does not evaluate"
            self.report("warning", "unresolved", at, msg + ": the trainer may see another value")
        if block is not None:
            msg = f"the trainer command is inside {block[0]} (line {block[1]}); it was read as if the block runs"
            self.report("warning", "unresolved", line, msg + ", with the variables as they are before it")
        self._check_tee(node)

    def _check_tee(self, cmd: Node) -> None:
        """ "$@" given to a command piped from (or chained after) the trainer never reaches the trainer."""
        top, pipe = cmd, None
        while top.parent is not None and top.parent.type in _CHAIN:
            top = top.parent
            pipe = pipe or (top if top.type == "pipeline" else None)
        scope, sib = [top], top.next_named_sibling
        while sib is not None and sib.start_point.row == cmd.end_point.row:
            scope, sib = [*scope, sib], sib.next_named_sibling
        for other in (c for s in scope for c in [s, *_descendants(s, "command")] if c.type == "command"):
            piped = pipe is not None and pipe.start_byte <= other.start_byte < pipe.end_byte
            if other == cmd or not (piped or other.start_byte >= cmd.end_byte):
                continue
            for arg in other.children_by_field_name("argument"):
                if any(_text(h) in ("@", "*") for h in _descendants(arg, "special_variable_name")):
                    where = "before the pipe" if piped else "into the trainer command"
                    name = _text(other.child_by_field_name("name") or other)
                    msg = f"{_text(arg)} is passed to {name} (line {_line(arg)}), not to the trainer: move it {where}"
                    self.report("error", "args-to-tee", _line(arg), msg)

    def _builtin(self, words: list[str], line: int) -> None:
        cmd, rest = (words[0], words[1:]) if words else ("", [])
        if cmd == "set":
            for i, flag in enumerate(rest):
                letters = flag[1:] if re.fullmatch(r"[-+][a-zA-Z]+", flag) else ""
                opt = rest[i + 1] if letters.endswith("o") and i + 1 < len(rest) else ""
                if "u" in letters or opt == "nounset":
                    self.nounset = flag[0] == "-"
                if "a" in letters or opt == "allexport":
                    self.allexport = flag[0] == "-"
        elif cmd == "shift":
            self.args = self.args[int(rest[0]) if rest and rest[0].isdigit() else 1 :]
        elif cmd == "unset":
            for name in (w for w in rest if not w.startswith("-")):
                self.vars.pop(name, None)
                self.exported.discard(name)
        elif cmd in _DECLARE:  # only when the grammar took the builtin for a plain command
            for name, eq, value in (w.partition("=") for w in rest if not w.startswith("-")):
                if eq:
                    self._set(name, value, _Taint())
                if cmd == "export":
                    self.exported.add(name)
        elif cmd in ("source", ".") and rest:
            self._source(rest[0], line)
        elif cmd in self.functions and cmd not in self.active:
            body, where = self.functions[cmd]
            saved, self.args, outer, self.file = self.args, rest, self.file, where
            self.active.append(cmd)
            try:
                self._block(body)
            finally:
                self.args, self.file = saved, outer
                self.active.pop()

    def _source(self, word: str, line: int) -> None:
        path = Path(word)
        if not path.is_absolute():  # relative to the script, never to preflight's own working directory
            dirs = (self.file.parent, self.main.parent)
            path = next((d / path for d in dirs if (d / path).is_file()), self.file.parent / path)
        if path.resolve() in self.active:
            return
        try:
            data = path.read_bytes()
        except OSError:
            msg = f"`source {word}`: {path} cannot be read here, so the variables it sets are unknown to preflight"
            self.report("warning", "unresolved", line, msg)
            return
        self.run_file(path, data)

    # words

    def _fields(self, node: Node, ctx: _Taint) -> list[str]:
        return _fields(self._tilde(self._pieces(node, ctx), ctx, _line(node)))

    def _tilde(self, pieces: Pieces, ctx: _Taint, line: int) -> Pieces:
        """~ and ~/x, also after NAME= as bash does (but not after data.path=, which is no assignment)."""
        if pieces and pieces[0][0] == LIT and (m := re.match(r"(?:[A-Za-z_]\w*=)?~(?=/|$)", pieces[0][1])):
            home = _scalar(self._var("HOME", ctx, line) or "~")
            pieces[0] = (LIT, m[0][:-1] + home + pieces[0][1][m.end() :])
        return pieces

    def _pieces(self, node: Node, ctx: _Taint, quoted: bool = False, lit: str = LIT) -> Pieces:
        kind, text = node.type, _text(node)
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
            if node.named_children and (value := self._calc(node.named_children[-1], ctx)) is not None:
                return [(QUOTED, str(value))]
            ctx.unknown[f"{text} cannot be computed statically; the trainer gets <{text}>"] = _line(node)
            return [(QUOTED, f"<{text}>")]
        if kind in ("command_substitution", "process_substitution"):
            inner = re.sub(r"[\"']", "", text[2:-1] if text.startswith("$(") else text[1:-1]).strip()
            if m := _SELF_DIR.fullmatch(inner):
                return [(QUOTED, str((self.main if m[1] == "0" else self.file).absolute().parent))]
            msg = f"{text} is a command's output, which preflight does not run; the trainer gets <{text}>"
            ctx.unknown[msg] = _line(node)
            return [(QUOTED, f"<{text}>")]
        return [(QUOTED, _unescape(text, True))] if quoted else [(lit, _unescape(text, False))]

    def _span(self, node: Node, ctx: _Taint, lo: int, hi: int, kids, quoted: bool, lit: str) -> Pieces:
        """Pieces of the kids within [lo, hi); text the grammar left between them is literal."""
        out: Pieces = []
        pos, raw = lo, node.text or b""

        def gap(a: int, b: int) -> None:
            if b > a:
                s = raw[a - node.start_byte : b - node.start_byte].decode()
                out.append((QUOTED, _unescape(s, True)) if quoted else (lit, _unescape(s, False)))

        for kid in kids:
            if kid.start_byte >= lo and kid.end_byte <= hi:
                gap(pos, kid.start_byte)
                out.extend(self._pieces(kid, ctx, quoted, lit))
                pos = kid.end_byte
        gap(pos, hi)
        return out

    def _var(self, name: str, ctx: _Taint, line: int) -> str | list[str] | None:
        ctx.merge(self.taint.get(name))
        if name in self.uncertain:
            ctx.uncertain[(name, *self.uncertain[name])] = None
        if name == "BASH_SOURCE" and name not in self.vars:
            return [str(self.file.absolute())]
        if name not in self.vars and _SHELL_PROVIDED.fullmatch(name):
            ctx.unknown[f"${name} belongs to the machine that runs the script; pass it in env to resolve it"] = line
            return f"<${name}>"
        return self.vars.get(name)

    def _expand(self, node: Node, ctx: _Taint, quoted: bool) -> Pieces:
        """$NAME and ${...}: the value, its length (${#...}), a default (${x:-...}) or a transformation."""
        kids = [c for c in node.children if c.type not in ("$", "${", "}")]
        hi = node.children[-1].start_byte if node.children[-1].type == "}" else node.end_byte
        prefix = kids.pop(0).type if len(kids) > 1 and kids[0].type in ("#", "!") else None
        if not kids:
            return [(LIT, _text(node))]
        line = _line(node)
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

    def _lookup(self, target: Node, ctx: _Taint, line: int) -> tuple[str, str | list[str] | None, bool]:
        """(name, value, whether it is $* / ${A[*]}) of an expansion's parameter."""
        name = _text(target)
        if target.type == "subscript":
            name, index = _text(target.child_by_field_name("name")), target.child_by_field_name("index")
            arr = self._var(name, ctx, line)
            items = arr if isinstance(arr, list) else ([] if arr is None else [arr])
            if _text(index) in ("@", "*"):
                return name, list(items), _text(index) == "*"
            i = self._calc(index, ctx) or 0
            return name, items[i] if i < len(items) else None, False
        if name in ("@", "*"):
            ctx.passthrough = True
            return name, list(self.args), name == "*"
        if name == "#":
            return name, str(len(self.args)), False
        if name.isdigit():
            return (
                name,
                str(self.main.absolute()) if name == "0" else dict(enumerate(self.args, 1)).get(int(name)),
                False,
            )
        if target.type == "special_variable_name":
            ctx.unknown[f"${name} is only known while the script runs"] = line
            return name, f"<${name}>", False
        val = self._var(name, ctx, line)
        if isinstance(val, list):  # $ARR is its first element
            val = val[0] if val else None
        return name, val, False

    def _operand(self, p: _Param, ctx: _Taint, quoted: bool, lo: int = 0, end: int = 0) -> Pieces:
        """The word after the operator (from ``lo`` to ``end`` when given)."""
        return self._span(p.node, ctx, lo or p.rest[0].end_byte, end or p.hi, p.rest[1:], quoted, UNQUOTED)

    def _defaulted(self, p: _Param, op: str, ctx: _Taint) -> Pieces:
        """${x:-w} ${x-w} ${x:=w} ${x=w} ${x:?w} ${x?w} ${x:+w} ${x+w}."""
        missing = p.val is None or (op[0] == ":" and not p.val)
        if op in (":+", "+") and not missing:
            return self._operand(p, ctx, p.quoted)
        if op in (":+", "+", ":?", "?") or not missing:
            if missing and "?" in op:
                message = _join(self._operand(p, ctx, True)) or "parameter null or not set"
                ctx.required.append((p.name, message, p.line))
            if not missing:
                return self._out(p.val, p.quoted, p.star)
            return [(QUOTED, "")] if p.quoted else []
        sub = _Taint()
        pieces = self._operand(p, sub, p.quoted)
        ctx.merge(sub)
        if "=" in op:
            self._set(p.name, _join(pieces), sub)
        return pieces

    def _transform(self, p: _Param, op: str, ctx: _Taint) -> Pieces:
        """${x#w} ${x%w} ${x/a/b} ${x,,} ${x^^} ${x:start:length}, on each element of an array value."""
        val, rest = p.val, p.rest
        values, apply = (val if isinstance(val, list) else [val]), None
        if op in ("#", "##", "%", "%%"):
            apply = functools.partial(_trim, op=op, pattern=_join(self._operand(p, ctx, True)))
        elif op in ("/", "//") and (cut := next((k for k in rest[1:] if k.type == "/"), None)):
            find = _join(self._operand(p, ctx, True, end=cut.start_byte))
            repl = _join(self._operand(p, ctx, True, lo=cut.end_byte))
            if not re.search(r"[*?\[]", find):
                apply = lambda v: v.replace(find, repl, -1 if op == "//" else 1)  # noqa: E731
        elif op in (",,", "^^"):
            apply = str.lower if op == ",," else str.upper
        elif op == ":" and (numbers := [self._calc(k, ctx) for k in rest[1:] if k.type != ":"]) and None not in numbers:
            start = numbers[0] - (p.name == "@")  # ${@:1} starts at $1, which is args[0]
            stop = start + numbers[1] if len(numbers) > 1 else None
            if isinstance(val, list):
                return self._out(values[start:stop], p.quoted, p.star)
            apply = lambda v: v[start:stop]  # noqa: E731
        if apply is None:
            text = _text(p.node)
            ctx.unknown[f"{text} is not understood by preflight; the trainer gets <{text}>"] = p.line
            return [(QUOTED, f"<{text}>")]
        mapped = [apply(v) for v in values]
        return self._out(mapped if isinstance(val, list) else mapped[0], p.quoted, p.star)

    @staticmethod
    def _out(val: str | list[str], quoted: bool, star: bool) -> Pieces:
        kind = QUOTED if quoted else UNQUOTED
        if not isinstance(val, list):
            return [(kind, val)]
        if quoted and star:
            return [(QUOTED, " ".join(val))]
        return [p for i, v in enumerate(val) for p in ([(BREAK, "")] if i else []) + [(kind, v)]]

    def _calc(self, node: Node, ctx: _Taint) -> int | None:
        try:
            return self._arith(node, ctx)
        except (ValueError, ZeroDivisionError):  # unknown values, bad numbers
            return None

    def _arith(self, node: Node, ctx: _Taint) -> int:
        """A safe evaluator for bash integer arithmetic (never Python's eval)."""
        kind, kids = node.type, node.named_children
        if kind == "number":
            return _int(_text(node))
        if kind in ("variable_name", "word") and _NAME.fullmatch(_text(node)):
            return self._arith_name(_text(node), ctx, _line(node))
        if kind in ("simple_expansion", "expansion", "string", "word", "concatenation"):
            return _int(_join(self._pieces(node, ctx)))
        if kind == "parenthesized_expression" and kids:
            return self._arith(kids[-1], ctx)
        if kind == "unary_expression" and kids and node.children[0].type in ("-", "+", "!", "~"):
            value = self._arith(kids[-1], ctx)
            return {"-": -value, "+": value, "!": int(not value), "~": ~value}[node.children[0].type]
        if kind == "binary_expression":
            op = node.child_by_field_name("operator").type
            left = self._arith(node.child_by_field_name("left"), ctx)
            right = self._arith(node.child_by_field_name("right"), ctx)
            if op in ("/", "%"):  # C semantics: truncate toward zero
                quotient = abs(left) // abs(right) * (1 if (left < 0) == (right < 0) else -1)
                return quotient if op == "/" else left - right * quotient
            if op in _ARITH:
                return _ARITH[op](left, right)
        raise ValueError(_text(node))

    def _arith_name(self, name: str, ctx: _Taint, line: int, depth: int = 0) -> int:
        val = self._var(name, ctx, line)
        if val is None:
            ctx.unset[(name, line, self.nounset)] = None
        text = _scalar(val or "").strip()
        if _NAME.fullmatch(text) and depth < 8:  # bash evaluates a variable holding a name as that variable
            return self._arith_name(text, ctx, line, depth + 1)
        return _int(text)

    def launch(self, source: str, data: bytes) -> Launch:
        if not self.trainers:
            msg = f"no command in {source} runs `python -m {TRAINER_MODULE}` (searched python, python3, pythonX.Y, "
            msg += "/path/to/python and $PYTHON-style commands, sourced files and called functions)"
            if (at := data.find(TRAINER_MODULE.encode())) >= 0:
                msg += f"; it is named at line {data[:at].count(b'\n') + 1}, but not in a command that runs"
            self.report("error", "no-trainer", None, msg)
            variables = {n: _scalar(v) for n, v in self.vars.items()}
            env = {n: v for n, v in variables.items() if n in self.exported}
            self.trainers.append(Launch("", None, None, (), (), env, variables, (), None))
        elif len(self.trainers) > 1:
            lines, last = ", ".join(str(t.trainer_line) for t in self.trainers), self.trainers[-1].trainer_line
            msg = f"the trainer is started {len(self.trainers)} times (lines {lines}); preflight checks the last one"
            self.report("warning", "multiple-trainers", last, msg)
        return replace(self.trainers[-1], source=source, findings=tuple(dict.fromkeys(self.findings)))


def read_launch_script(path: str | Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Launch:
    """The trainer invocation of `bash PATH ARGS...` run with environment ENV (default: empty), read statically."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LaunchError(f"cannot read launch script {path}: {exc.strerror or exc}") from exc
    shell = _Shell(path, args, env or {})
    shell.run_file(path, data)
    return shell.launch(str(path), data)


def launch_from_overrides(overrides: Sequence[str]) -> Launch:
    """A Launch for a plain Hydra override list, as given after `python -m verl.trainer.main_ppo`."""
    config, rest = _split_config(list(overrides))
    return Launch("<overrides>", TRAINER_MODULE, config, rest, (), {}, {}, (), None)
