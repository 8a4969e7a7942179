"""Whether bash reaches a command: the conditions around it (``if``, ``case``, loops, ``&&``/``||``), read statically.

The static shell (``verl_npu.preflight.shell``) does not run the blocks of a script, but whether the trainer runs, or
an ``exit`` before it, is decided by their conditions. This module says, for a command inside such constructs, what
the conditions on its path are (:meth:`Flow.path`) and what they evaluate to (:meth:`Flow.status`); :func:`decide`
turns them into yes, no or unknown.

What a condition tests is evaluated where preflight knows it: ``true``/``false``/``:``, ``[ ... ]`` and ``test``
(POSIX's rules by argument count), ``[[ ... ]]`` (strings, patterns, integers), ``(( ... ))``, ``case`` patterns and
``for`` lists. A file test, a regex, a value only the running script has, or a variable that is not set here is
unknown: preflight never guesses it. Any other command's status is *assumed*: preflight reads a launch as if its
commands succeed (as it does for every command before the trainer), which decides a guard such as
``ray status || exit 1`` (no exit) and ``cd dir && python3 -m ...`` (the trainer runs), but never an exit that
only a command's success triggers, or a trainer that only its failure starts: those are unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from tree_sitter import Node

YES, NO, UNKNOWN = "yes", "no", "unknown"
_FILE_TESTS = {"-a", "-b", "-c", "-d", "-e", "-f", "-g", "-h", "-k", "-p", "-r", "-s", "-t", "-u", "-w", "-x", "-G",
               "-L", "-N", "-O", "-S"}  # fmt: skip
_INT_OPS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__, "-gt": int.__gt__,
            "-ge": int.__ge__}  # fmt: skip
_STR_OPS = {"=": str.__eq__, "==": str.__eq__, "!=": str.__ne__, "<": str.__lt__, ">": str.__gt__}
_DECIMAL = re.compile(r"[ \t\n]*[-+]?[0-9]+[ \t\n]*")  # what test(1) reads as an integer: ASCII digits only


class Unknown(Exception):
    """A condition preflight cannot evaluate; the message says why."""


@dataclass(frozen=True)
class Cond:
    """One condition on the path to a command: its value (None: unknown), and the value the command needs."""

    value: bool | None
    assumed: bool  # the value is preflight's assumption that a command succeeds, not an evaluation
    need: bool
    line: int
    text: str  # the condition as written, for messages
    why: str = ""  # why the value is unknown


def decide(conds: list[Cond], role: str) -> tuple[str, Cond | None]:
    """(YES, NO or UNKNOWN, the deciding condition) for a command on a path with ``conds``.

    ``role`` is "trainer", "exit" or "other": an assumed success runs a trainer (and any other command) that needs
    it, but no exit that needs it; an assumed success skips an exit that needs a failure, and leaves a trainer that
    needs one unknown.
    """
    unknown = None
    for cond in conds:
        if cond.value is None:
            unknown = unknown or cond
        elif not cond.assumed:
            if cond.value != cond.need:
                return NO, cond
        elif cond.value == cond.need:
            if role == "exit":
                unknown = unknown or cond
        elif role == "trainer":
            unknown = unknown or cond
        else:
            return NO, cond
    return (UNKNOWN, unknown) if unknown else (YES, None)


def posix_test(args: list[str], is_set) -> bool:
    """``test ARGS`` / ``[ ARGS ]``: POSIX's rules by argument count (bash's for up to four); raises Unknown."""
    n = len(args)
    if n == 0:
        return False
    if n == 1:
        return args[0] != ""
    if args[0] == "!" and n <= 4:
        return not posix_test(args[1:], is_set)
    if n == 2:
        return _unary(args[0], args[1], is_set)
    if n == 3:
        if args[1] in _STR_OPS or args[1] in _INT_OPS or args[1] in ("-a", "-o"):
            return _binary(args[0], args[1], args[2], is_set)
        if args[0] == "(" and args[2] == ")":
            return args[1] != ""
    if n == 4 and args[0] == "(" and args[3] == ")":
        return posix_test(args[1:3], is_set)
    raise Unknown("preflight does not evaluate this form of test")


def _unary(op: str, operand: str, is_set) -> bool:
    if op == "-n":
        return operand != ""
    if op == "-z":
        return operand == ""
    if op == "-v":
        return is_set(operand)
    if op in _FILE_TESTS:
        raise Unknown(f"`{op}` tests the file system of the machine that runs the script")
    raise Unknown(f"preflight does not evaluate `{op}`")


def _binary(left: str, op: str, right: str, is_set, pattern: str | None = None) -> bool:
    if op in ("-a", "-o"):
        return (left != "" and right != "") if op == "-a" else (left != "" or right != "")
    if op in _INT_OPS:
        if not (_DECIMAL.fullmatch(left) and _DECIMAL.fullmatch(right)):
            raise Unknown(f"`{left} {op} {right}` compares values that are not integers")
        return _INT_OPS[op](int(left), int(right))
    if pattern is not None and op in ("=", "==", "!="):
        return fnmatchcase(left, pattern) == (op != "!=")
    return _STR_OPS[op](left, right)


class Flow:
    """The conditions on a command's path, for the static shell (which provides ``_cond_word`` and ``_cond_arith``)."""

    def _cond_word(self, node: Node, split: bool) -> list[str] | tuple[str, str]:
        raise NotImplementedError

    def _cond_arith(self, node: Node, lo: int, hi: int) -> int:
        raise NotImplementedError

    def _is_set(self, name: str) -> bool:
        raise NotImplementedError

    def path(self, command: Node, top: Node) -> tuple[list[Cond], bool]:
        """The conditions between ``top`` and ``command`` (outermost first), and whether ``command`` runs in a
        subshell there (a pipeline, ``( ... )``, a function defined there): an ``exit`` in it ends no script."""
        conds: list[Cond] = []
        isolated = False
        child, node = command, command.parent
        while node is not None and child != top:
            kind = node.type
            if kind in ("subshell", "function_definition") or (kind == "pipeline" and len(node.named_children) > 1):
                isolated = True
            elif kind == "list" and child != node.named_children[0]:
                op = next(c for c in node.children if c.type in ("&&", "||"))
                conds.append(self.status(node.named_children[0], op.type == "&&"))
            elif kind in ("if_statement", "elif_clause"):
                conds.extend(self._if_path(node, child))
            elif kind == "while_statement" and child == node.child_by_field_name("body"):
                conds.append(self._last(node.children_by_field_name("condition"), node.children[0].type == "while"))
            elif kind == "for_statement" and child == node.child_by_field_name("body"):
                conds.append(self._for(node))
            elif kind == "c_style_for_statement" and child == node.child_by_field_name("body"):
                conds.append(Cond(None, False, True, _line(node), "for ((...))", "preflight does not run loops"))
            elif kind == "case_statement" and child.type == "case_item":
                conds.append(self._case(node, child))
            child, node = node, node.parent
        return conds[::-1], isolated

    def _if_path(self, node: Node, child: Node) -> list[Cond]:
        kids = node.children
        then = next((i for i, k in enumerate(kids) if k.type == "then"), len(kids))
        condition = [k for k in kids[:then] if k.is_named]
        if any(child == c for c in condition):
            return []  # the condition itself runs whenever the block does
        if child.type in ("elif_clause", "else_clause"):
            conds = [self._last(condition, False)]
            if node.type == "if_statement":
                for clause in (k for k in kids if k.type == "elif_clause" and k.start_byte < child.start_byte):
                    inner = clause.children
                    at = next((i for i, k in enumerate(inner) if k.type == "then"), len(inner))
                    conds.append(self._last([k for k in inner[:at] if k.is_named], False))
            return conds
        return [self._last(condition, True)]

    def _last(self, statements: list[Node], need: bool) -> Cond:
        statements = [s for s in statements if s.is_named and s.type != "comment"]
        if not statements:
            return Cond(True, False, need, 0, "")
        return self.status(statements[-1], need)

    def status(self, node: Node, need: bool) -> Cond:
        """The condition that ``node``'s exit status is what the command after it needs (success when ``need``)."""
        text, line = " ".join((node.text or b"").decode(errors="replace").split())[:80], _line(node)
        try:
            if _malformed(node):  # bash refuses the whole command when it is read, whatever runs first
                raise Unknown("a [[ ]] in it is no valid conditional expression")
            value, assumed = self._status(node)
        except Unknown as exc:
            return Cond(None, False, need, line, text, str(exc))
        return Cond(value, assumed, need, line, text)

    def _status(self, node: Node) -> tuple[bool, bool]:
        """(exit status is success, whether that is assumed); raises Unknown."""
        kind = node.type
        named = [c for c in node.named_children if c.type != "comment"]
        if kind == "negated_command" and named:
            if named[-1].type == "negated_command" or (named[-1].text or b"").startswith(b"!"):
                raise Unknown("preflight does not evaluate `! !`")
            value, assumed = self._status(named[-1])
            return not value, assumed
        if kind == "list" and len(named) == 2:
            op = next(c for c in node.children if c.type in ("&&", "||"))
            left = self._status(named[0])
            if left[0] != (op.type == "&&"):
                return left  # the right side never runs (or, for an assumed status, is assumed not to)
            right = self._status(named[1])
            return right[0], left[1] or right[1]
        if kind == "subshell" and (node.text or b"").startswith(b"(("):  # the grammar's misreading of ! (( ... ))
            raise Unknown("preflight does not evaluate this form of (( ))")
        if kind in ("compound_statement", "subshell", "redirected_statement") and named:
            if kind == "compound_statement" and node.children[0].type == "((":
                kids = node.children
                return self._cond_arith(node, kids[0].end_byte, kids[-1].start_byte) != 0, False
            body = node.child_by_field_name("body") if kind == "redirected_statement" else None
            return self._status(body or named[-1])
        if kind == "pipeline" and named:
            value, _ = self._status(named[-1])
            return value, len(named) > 1  # pipefail or not, the other commands' statuses are assumed
        if kind == "test_command":
            return self._test(node), False
        if kind in ("variable_assignment", "variable_assignments", "declaration_command"):
            return True, True
        if kind == "command":
            name = node.child_by_field_name("name")
            words = self._cond_word(name, True) if name is not None else []
            if words[:1] in (["true"], [":"]):
                return True, False
            if words[:1] == ["false"]:
                return False, False
            args = [w for a in node.children_by_field_name("argument") for w in self._cond_word(a, True)]
            if words[:1] in (["test"], ["["]):
                return posix_test(args[:-1] if words[0] == "[" and args[-1:] == ["]"] else args, self._is_set), False
            return True, True
        raise Unknown("preflight does not evaluate this construct")

    def _test(self, node: Node) -> bool:
        kids = [c for c in node.children if c.type != "comment"]
        inner = kids[1:-1]
        if kids[0].type == "[[":
            if len(inner) != 1:
                raise Unknown("preflight does not evaluate this form of [[ ]]")
            return self._double(inner[0])
        args = [w for k in inner for w in self._flat(k)]
        return posix_test(args, self._is_set)

    def _flat(self, node: Node) -> list[str]:
        """A ``[ ... ]`` expression as the words ``test`` gets (the grammar nests them; test reads them flat)."""
        if node.type in ("unary_expression", "binary_expression", "parenthesized_expression"):
            return [w for k in node.children for w in self._flat(k)]
        if not node.is_named or node.type == "test_operator":
            return [(node.text or b"").decode(errors="replace")]
        words = self._cond_word(node, True)
        return list(words) if isinstance(words, list) else [words[0]]

    def _double(self, node: Node) -> bool:
        """``[[ ... ]]``: no word splitting, a pattern on the right of ``==``/``!=``, integers for ``-eq`` and so on."""
        kind = node.type
        if kind == "parenthesized_expression":
            return self._double(next(c for c in node.named_children))
        if kind == "unary_expression":
            op, operand = node.children[0], node.named_children[-1]
            if op.type == "!":
                return not self._double(operand)
            return _unary((op.text or b"").decode(), self._string(operand), self._is_set)
        if kind == "binary_expression":
            op_node = node.child_by_field_name("operator")
            op = (op_node.text or b"").decode() if op_node is not None else ""
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            if left is None or right is None:
                raise Unknown("preflight does not evaluate this form of [[ ]]")
            if op in ("&&", "-a"):
                return self._double(left) and self._double(right)
            if op in ("||", "-o"):
                return self._double(left) or self._double(right)
            if op in _INT_OPS:
                a = self._cond_arith(left, left.start_byte, left.end_byte)
                b = self._cond_arith(right, right.start_byte, right.end_byte)
                return _INT_OPS[op](a, b)
            if op in ("=", "==", "!="):
                return _binary(self._string(left), op, "", self._is_set, pattern=self._glob(right))
            if op in ("<", ">"):
                return _binary(self._string(left), op, self._string(right), self._is_set)
            raise Unknown(f"preflight does not evaluate `{op}`" if op else "preflight does not evaluate this test")
        return self._string(node) != ""

    def _string(self, node: Node) -> str:
        words = self._cond_word(node, False)
        return words[0]

    def _glob(self, node: Node) -> str:
        words = self._cond_word(node, False)
        return words[1]

    def _for(self, node: Node) -> Cond:
        values = node.children_by_field_name("value")
        text, line = f"for {(node.child_by_field_name('variable').text or b'').decode()} in ...", _line(node)
        try:
            words = [w for v in values for w in self._cond_word(v, True)] if values else self._positional()
        except Unknown as exc:
            return Cond(None, False, True, line, text, str(exc))
        return Cond(bool(words), False, True, line, text)

    def _positional(self) -> list[str]:
        raise NotImplementedError

    def _case(self, node: Node, item: Node) -> Cond:
        value = node.child_by_field_name("value")
        line, text = _line(item), f"case {(value.text or b'').decode() if value else ''} in ..."
        try:
            subject = self._string(value) if value is not None else ""
            for other in node.children:
                if other.type != "case_item":
                    continue
                matched = any(fnmatchcase(subject, self._glob(p)) for p in other.children_by_field_name("value"))
                if other == item:
                    return Cond(matched, False, True, line, text)
                if matched:
                    return Cond(False, False, True, line, text)
                if any(t.type in (";&", ";;&") for t in other.children):
                    raise Unknown("preflight does not follow ;& and ;;& between case items")
        except Unknown as exc:
            return Cond(None, False, True, line, text, str(exc))
        return Cond(False, False, True, line, text)


def _malformed(node: Node) -> bool:
    """Whether a ``[[ ]]`` in ``node`` may be one bash refuses: a word like an operator where a value goes
    (``[[ -n == 1 ]]``), or a unary test of a test (``[[ -n -ge 1 ]]``)."""
    stack, inside = [node], False
    while stack:
        kid = stack.pop()
        if kid.type == "test_command" and kid.children and kid.children[0].type == "[[":
            inside = True
        if inside and kid.type == "word" and (kid.text or b"").startswith(b"-"):
            return True
        operand = kid.named_children[-1].type if kid.named_children else ""
        unary = kid.type == "unary_expression" and kid.children[0].type != "!"
        if inside and unary and operand.endswith("_expression"):
            return True
        stack.extend(kid.named_children)
    return False


def _line(node: Node) -> int:
    return node.start_point.row + 1
