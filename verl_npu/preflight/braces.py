"""Bash's brace expansion, on a word's pieces: ``key={64,128}`` is the two words ``key=64 key=128``.

Bash expands braces first, on the word's text, before any other expansion, and only where the braces are unquoted
and unescaped literal text. A word here is a list of pieces (``verl_npu.preflight.shell``): only the characters
of LIT pieces may open, separate or close a brace; every other piece (a quoted string, an expansion's value) is
one opaque unit that is copied into each word it falls in. A brace with neither an unquoted comma nor a valid
sequence (``{a}``, ``{}``, ``{a..3}``) stays literal, and the braces inside and after it are still expanded, as
bash does (``{{,}}`` is ``{} {}``).

The number of words is checked before they are built, so ``{1..9999999999}`` raises :class:`TooMany` instead of
using the memory bash itself would.
"""

from __future__ import annotations

import re
from itertools import pairwise

LIT = "lit"  # the kind of an unquoted literal piece (verl_npu.preflight.shell.LIT)
_INT_SEQUENCE = re.compile(r"([-+]?[0-9]+)\.\.([-+]?[0-9]+)(?:\.\.([-+]?[0-9]+))?")
_CHAR_SEQUENCE = re.compile(r"([A-Za-z])\.\.([A-Za-z])(?:\.\.([-+]?[0-9]+))?")

Item = str | tuple[str, str]  # one eligible character, or an opaque piece (kind, text)


class TooMany(Exception):
    """The expansion would make more than the allowed number of words."""


class Unclear(Exception):
    """Bash reads ``{}`` next to other braces by rules of its own (``{},a}`` is two words, ``{0..0}{},a}`` one)."""


def expand(pieces: list[tuple[str, str]], limit: int) -> list[list[tuple[str, str]]]:
    """The words (each a list of pieces) that brace expansion makes of one word; at most ``limit`` of them."""
    if not any(kind == LIT and "{" in text for kind, text in pieces):
        return [pieces]
    items: list[Item] = [c for kind, text in pieces for c in (text if kind == LIT else [(kind, text)])]
    empty = any(a == "{" and b == "}" for a, b in pairwise(items))
    if empty and sum(1 for c in items if c in ("{", "}")) > 2:
        raise Unclear
    return [_pieces(word) for word in _expand(items, limit)]


def _pieces(items: list[Item]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, tuple):
            out.append(item)
        elif out and out[-1][0] == LIT:
            out[-1] = (LIT, out[-1][1] + item)
        else:
            out.append((LIT, item))
    return out


def _expand(items: list[Item], limit: int) -> list[list[Item]]:
    start = 0
    while True:
        opening = _find(items, "{", start)
        if opening is None:
            return [items]
        closing, commas, sequence = _match(items, opening, limit)
        if closing is None:  # no brace that closes it into a list or sequence: bash tries the next opening brace
            start = opening + 1
            continue
        if commas:
            bounds = [opening, *commas, closing]
            alternatives = [w for a, b in pairwise(bounds) for w in _expand(items[a + 1 : b], limit)]
        else:
            alternatives = [list(word) for word in sequence or ()]
        tails = _expand(items[closing + 1 :], limit)
        if len(alternatives) * len(tails) > limit:
            raise TooMany
        head = items[:opening]
        return [head + alternative + tail for alternative in alternatives for tail in tails]


def _find(items: list[Item], char: str, start: int) -> int | None:
    for i in range(start, len(items)):
        if items[i] == char and not (char == "{" and i and items[i - 1] == "$"):
            return i
    return None


def _match(items: list[Item], opening: int, limit: int) -> tuple[int | None, list[int], list[str] | None]:
    """The brace closing ``opening`` into a list (with the commas directly inside it) or a sequence (with its words).

    A closing brace with neither before it is text (``{a},b}`` is ``a}`` and ``b``), as bash reads it.
    """
    depth, commas = 0, []
    for i in range(opening + 1, len(items)):
        item = items[i]
        if item == "{":
            depth += 1
        elif item == "}" and depth:
            depth -= 1
        elif item == "}":
            if commas:
                return i, commas, None
            if (sequence := _sequence(items[opening + 1 : i], limit)) is not None:
                return i, [], sequence
        elif item == "," and depth == 0:
            commas.append(i)
    return None, [], None


def _sequence(amble: list[Item], limit: int) -> list[str] | None:
    """``{1..5}``, ``{05..1..2}``, ``{a..e}``: the words, or None where the text is no sequence."""
    if not all(isinstance(c, str) for c in amble):
        return None
    text = "".join(amble)  # type: ignore[arg-type]
    if m := _INT_SEQUENCE.fullmatch(text):
        first, last = int(m[1]), int(m[2])
        values = _steps(first, last, m[3], limit)
        padded = [s.lstrip("+-") for s in (m[1], m[2])]
        width = max(len(m[1]), len(m[2])) if any(len(s) > 1 and s.startswith("0") for s in padded) else 0
        return [f"{v:0{width}d}" for v in values]
    if m := _CHAR_SEQUENCE.fullmatch(text):
        return [chr(v) for v in _steps(ord(m[1]), ord(m[2]), m[3], limit)]
    return None


def _steps(first: int, last: int, increment: str | None, limit: int) -> range:
    step = abs(int(increment)) if increment else 1
    step = step or 1  # bash takes an increment of 0 as 1
    if abs(last - first) // step + 1 > limit:
        raise TooMany
    return range(first, last + 1, step) if first <= last else range(first, last - 1, -step)
