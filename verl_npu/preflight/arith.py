"""Bash integer arithmetic (``$((...))``, ``((...))``, ``let``, array subscripts), evaluated as bash does.

Bash evaluates in 64-bit two's complement and wraps on overflow: ``$(( 10 ** (10 ** 10) ))`` is 0 at once, and so
it is here (powers are taken modulo 2**64, never as Python's unbounded integers). The grammar and precedence are
bash's (``expr.c``), not tree-sitter's: ``2 ** 3 ** 2`` is 512 and ``-2 ** 2`` is 4. Variables hold text that is
itself evaluated as an expression when referenced (``A=1+2; $((A * 2))`` is 6).

What bash rejects (division by 0, a bad constant, a syntax error) raises :class:`ArithError` with bash's reason;
what is too deep to evaluate within preflight's bounds raises :class:`Limit`. Never Python's ``eval``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
_MASK = (1 << 64) - 1
MAX_DEPTH = 64  # nested parentheses, unary operators, right-associative chains and variables holding expressions
MAX_TEXT = 1 << 16  # characters of one expression
MAX_EVALUATIONS = 10_000  # texts evaluated for one expression: variables holding expressions are each one


class ArithError(ValueError):
    """Bash itself fails on the expression (and a non-interactive bash stops the script there)."""


class Limit(Exception):
    """Evaluating this needs more than preflight's bounds allow (the message says which)."""


def wrap(value: int) -> int:
    """A Python integer as bash's 64-bit signed integer holds it."""
    value &= _MASK
    return value - (1 << 64) if value > INT_MAX else value


_DIGITS = {c: i for i, c in enumerate("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ@_")}
_CONSTANT = re.compile(r"[0-9][0-9A-Za-z@_#]*")


def constant(text: str) -> int:
    """A bash integer constant: decimal, 0x hex, 0 octal or BASE#DIGITS (2..64), wrapped to 64 bits."""
    if "#" in text:
        base_text, _, digits = text.partition("#")
        if not base_text.isdigit() or not 2 <= int(base_text[:4]) <= 64 or len(base_text) > 2:
            raise ArithError(f"{text}: invalid arithmetic base")
        base = int(base_text)
        if not digits:
            raise ArithError(f"{text}: invalid integer constant")
    elif text[:2] in ("0x", "0X"):
        base, digits = 16, text[2:]
    elif text.startswith("0"):
        base, digits = 8, text
    else:
        base, digits = 10, text
    value = 0
    for c in digits:
        d = _DIGITS.get(c.lower() if base <= 36 else c)
        if d is None or d >= base:
            raise ArithError(f"{text}: value too great for base")
        value = (value * base + d) & _MASK
    return wrap(value)


_TOKEN = re.compile(
    r"[ \t\n\r]*(?:(?P<num>[0-9][0-9A-Za-z@_#]*)|(?P<id>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op><<=|>>=|\*\*|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&^|]=|[-+*/%<>=!~&^|?:,()\[\]]))"
)
_ASSIGN = {"=", "*=", "/=", "%=", "+=", "-=", "<<=", ">>=", "&=", "^=", "|="}
# left-associative binary levels, loosest first; && and || short-circuit
_LEVELS = (("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"), ("+", "-"))
_LEVELS += (("*", "/", "%"),)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos, end = 0, len(text)
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            rest = text[pos:].strip()
            if not rest:
                break
            raise ArithError(f"{text}: syntax error: invalid arithmetic operator (error token is {rest[:20]!r})")
        pos = m.end()
        kind = m.lastgroup
        if kind is None:  # only whitespace was left
            break
        out.append((kind, m[kind]))
    # ++/-- are increments next to a name; elsewhere two signs (bash: --5 is 5)
    fixed: list[tuple[str, str]] = []
    for i, (kind, tok) in enumerate(out):
        if tok in ("++", "--"):
            if fixed and (fixed[-1][0] == "id" or fixed[-1][1] == "]"):
                fixed.append(("post", tok))
                continue
            if i + 1 < len(out) and out[i + 1][0] == "id":
                fixed.append(("pre", tok))
                continue
            fixed += [("op", tok[0]), ("op", tok[0])]
            continue
        fixed.append((kind, tok))
    return fixed


class _Parser:
    """Recursive descent over bash's precedence; the AST is nested tuples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        if self.i >= len(self.toks):
            raise ArithError(f"{self.text}: syntax error: operand expected")
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, tok: str) -> None:
        if self.peek() != tok:
            got = self.peek()
            raise ArithError(
                f"{self.text}: syntax error: {tok!r} expected" + (f" (error token is {got!r})" if got else "")
            )
        self.i += 1

    def parse(self) -> tuple:
        if not self.toks:
            return ("num", 0)
        node = self.comma()
        if self.i < len(self.toks):
            raise ArithError(f"{self.text}: syntax error in expression (error token is {self.toks[self.i][1]!r})")
        return node

    def deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Limit(f"the expression nests deeper than {MAX_DEPTH} levels")

    def comma(self) -> tuple:
        items = [self.assign()]
        while self.peek() == ",":
            self.i += 1
            items.append(self.assign())
        return items[0] if len(items) == 1 else ("comma", items)

    def assign(self) -> tuple:
        self.deeper()
        try:
            left = self.ternary()
            if self.peek() in _ASSIGN and self.i < len(self.toks) and self.toks[self.i][0] == "op":
                op = self.take()[1]
                if left[0] != "var":
                    raise ArithError(f"{self.text}: attempted assignment to non-variable (error token is {op!r})")
                return ("assign", op, left, self.assign())
            return left
        finally:
            self.depth -= 1

    def ternary(self) -> tuple:
        cond = self.binary(0)
        if self.peek() != "?":
            return cond
        self.i += 1
        self.deeper()
        try:
            yes = self.comma()
            self.expect(":")
            no = self.ternary()
        finally:
            self.depth -= 1
        return ("?", cond, yes, no)

    def binary(self, level: int) -> tuple:
        if level == len(_LEVELS):
            return self.power()
        ops = _LEVELS[level]
        first = self.binary(level + 1)
        rest = []
        while self.peek() in ops and self.toks[self.i][0] == "op":
            op = self.take()[1]
            rest.append((op, self.binary(level + 1)))
        return ("chain", first, rest) if rest else first

    def power(self) -> tuple:
        base = self.unary()
        if self.peek() != "**":
            return base
        self.i += 1
        self.deeper()
        try:
            return ("**", base, self.power())  # right-associative
        finally:
            self.depth -= 1

    def unary(self) -> tuple:
        kind, tok = self.toks[self.i] if self.i < len(self.toks) else ("", "")
        if kind == "op" and tok in ("-", "+", "!", "~"):
            self.i += 1
            self.deeper()
            try:
                return ("unary", tok, self.unary())
            finally:
                self.depth -= 1
        if kind == "pre":
            self.i += 1
            return ("pre", tok, self.variable(self.take()))
        return self.postfix()

    def postfix(self) -> tuple:
        kind, tok = self.take()
        if kind == "num":
            node: tuple = ("num", constant(tok))
        elif kind == "id":
            node = self.variable((kind, tok))
        elif tok == "(":
            self.deeper()
            try:
                node = self.comma()
            finally:
                self.depth -= 1
            self.expect(")")
        else:
            raise ArithError(f"{self.text}: syntax error: operand expected (error token is {tok!r})")
        if self.i < len(self.toks) and self.toks[self.i][0] == "post":
            if node[0] != "var":
                raise ArithError(f"{self.text}: syntax error in expression")
            return ("post", self.take()[1], node)
        return node

    def variable(self, token: tuple[str, str]) -> tuple:
        if token[0] != "id":
            raise ArithError(f"{self.text}: syntax error: operand expected (error token is {token[1]!r})")
        index = None
        if self.peek() == "[":
            self.i += 1
            self.deeper()
            try:
                index = self.comma()
            finally:
                self.depth -= 1
            self.expect("]")
        return ("var", token[1], index)


def _divide(op: str, left: int, right: int, text: str, noeval: bool = False) -> int:
    if right == 0:
        if noeval:  # an operand bash skips (after || and &&, the ternary's other branch) divides by 0 silently
            return 0
        raise ArithError(f"{text}: division by 0")
    if left == INT_MIN and right == -1:  # bash's special case, not a trap
        return INT_MIN if op.startswith("/") else 0
    quotient = abs(left) // abs(right) * (1 if (left < 0) == (right < 0) else -1)  # C truncates toward zero
    return quotient if op.startswith("/") else left - right * quotient


def _apply(op: str, left: int, right: int, text: str, noeval: bool = False) -> int:
    if op in ("/", "%"):
        return _divide(op, left, right, text, noeval)
    if op == "**":
        if right < 0:  # checked even in an operand bash skips (bash 5.2's expr.c does)
            raise ArithError(f"{text}: exponent less than 0")
        return wrap(pow(left, right, 1 << 64))
    if op in ("<<", ">>"):
        right &= 63  # the count as the machine's shift instruction takes it
        return wrap(left << right) if op == "<<" else left >> right
    result = {
        "+": lambda: left + right,
        "-": lambda: left - right,
        "*": lambda: left * right,
        "&": lambda: left & right,
        "|": lambda: left | right,
        "^": lambda: left ^ right,
        "==": lambda: int(left == right),
        "!=": lambda: int(left != right),
        "<": lambda: int(left < right),
        ">": lambda: int(left > right),
        "<=": lambda: int(left <= right),
        ">=": lambda: int(left >= right),
    }[op]()
    return wrap(result)


Lookup = Callable[[str, "int | None"], "str | None"]
Store = Callable[[str, "int | None", int], None]


class Arith:
    """Evaluates bash arithmetic; variables come from ``lookup(name, index)`` (their text, None when unset) and
    assignments go to ``store(name, index, value)``."""

    def __init__(self, lookup: Lookup, store: Store) -> None:
        self.lookup = lookup
        self._store = store
        self.depth = 0
        self.evaluations = 0
        self.noeval = 0  # > 0 inside an operand bash skips: evaluated for its errors, without side effects

    def store(self, name: str, index: int | None, value: int) -> None:
        if not self.noeval:
            self._store(name, index, value)

    def _skipped(self, node: tuple, text: str) -> None:
        """An operand bash parses and checks but does not use (short-circuit, the ternary's other branch)."""
        self.noeval += 1
        try:
            self._eval(node, text)
        finally:
            self.noeval -= 1

    def __call__(self, text: str) -> int:
        if len(text) > MAX_TEXT:
            raise Limit(f"the expression is longer than {MAX_TEXT} characters")
        self.evaluations += 1
        if self.evaluations > MAX_EVALUATIONS:  # V1='V2+V2', V2='V3+V3', ...: exponential without a depth limit
            raise Limit(f"evaluating it takes more than {MAX_EVALUATIONS} variable expansions")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise Limit(f"variables hold expressions that refer to each other deeper than {MAX_DEPTH} levels")
            parser = _Parser(text)
            return self._eval(parser.parse(), text)
        finally:
            self.depth -= 1

    def _value(self, node: tuple, text: str) -> tuple[str, int | None, int]:
        _, name, index_node = node
        index = None if index_node is None else self._eval(index_node, text)
        if self.noeval:  # bash reads no variable in an operand it skips (expr.c's expr_streval): 0
            return name, index, 0
        raw = self.lookup(name, index)
        value = (raw or "").strip(" \t\n")
        if not value:
            return name, index, 0
        if _CONSTANT.fullmatch(value):
            return name, index, constant(value)
        return name, index, self(value)  # a variable's text is an expression too

    def _eval(self, node: tuple, text: str) -> int:
        kind = node[0]
        if kind == "num":
            return node[1]
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH * 2:
                raise Limit(f"the expression nests deeper than {MAX_DEPTH} levels")
            return self._eval_node(kind, node, text)
        finally:
            self.depth -= 1

    def _eval_node(self, kind: str, node: tuple, text: str) -> int:
        if kind == "var":
            return self._value(node, text)[2]
        if kind == "chain":
            value = self._eval(node[1], text)
            for op, operand in node[2]:
                if op in ("&&", "||") and bool(value) == (op == "||"):  # decided: the operand is skipped
                    self._skipped(operand, text)
                    value = int(bool(value))
                elif op in ("&&", "||"):
                    value = int(bool(self._eval(operand, text)))
                else:
                    value = _apply(op, value, self._eval(operand, text), text, bool(self.noeval))
            return value
        if kind == "**":
            return _apply("**", self._eval(node[1], text), self._eval(node[2], text), text)
        if kind == "unary":
            value = self._eval(node[2], text)
            return wrap({"-": -value, "+": value, "!": int(not value), "~": ~value}[node[1]])
        if kind == "?":
            taken, skipped = (node[2], node[3]) if self._eval(node[1], text) else (node[3], node[2])
            self._skipped(skipped, text)
            return self._eval(taken, text)
        if kind == "comma":
            value = 0
            for item in node[1]:
                value = self._eval(item, text)
            return value
        if kind in ("pre", "post"):
            name, index, old = self._value(node[2], text)
            new = wrap(old + (1 if node[1] == "++" else -1))
            self.store(name, index, new)
            return new if kind == "pre" else old
        if kind == "assign":
            op, target, rhs = node[1], node[2], node[3]
            right = self._eval(rhs, text)
            if op == "=":
                _, name, index_node = target
                index = None if index_node is None else self._eval(index_node, text)
                value = right
            else:
                name, index, old = self._value(target, text)
                value = _apply(op[:-1], old, right, text, bool(self.noeval))
            self.store(name, index, value)
            return value
        raise ArithError(f"{text}: syntax error")  # pragma: no cover - the parser makes no other nodes
