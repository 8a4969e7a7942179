"""One vocabulary for every verdict verl-npu prints: ok / warn / fail, one record type, one table, one JSON form.

``verl-npu doctor`` (each finding), ``verl-npu preflight`` (each check of a launch) and ``verl-npu ci
compare`` (each metric) speak it. Importing this module costs nothing beyond the standard library: rich is loaded
only when a table is drawn, so light entry points (the cluster network check, install-time tools)
can use the records without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

OK, WARN, FAIL = "ok", "warn", "fail"
STATUSES = (OK, WARN, FAIL)  # best to worst
STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red"}


@dataclasses.dataclass(frozen=True)
class Check:
    """One verdict: ``check`` is a stable dotted id (``version.torch``), ``fix`` what to do when it is not ok."""

    check: str
    status: str
    detail: str
    fix: str = ""

    @property
    def area(self) -> str:
        """The id's first part: ``version`` for ``version.torch``, ``mesh`` for ``mesh.actor-tp``."""
        return self.check.partition(".")[0]

    @property
    def name(self) -> str:
        """The id without its area: ``actor-tp`` for ``mesh.actor-tp``."""
        return self.check.partition(".")[2]

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def worst(statuses: Iterable[str]) -> str:
    """The worst of ``statuses`` (ok when there are none)."""
    return max(statuses, key=STATUSES.index, default=OK)


def failed(checks: Iterable[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def counts(checks: Iterable[Check]) -> dict[str, int]:
    """status -> how many checks have it (every status present, zero or not)."""
    out = dict.fromkeys(STATUSES, 0)
    for c in checks:
        out[c.status] += 1
    return out


def summary(checks: Iterable[Check]) -> str:
    """``"1 failed, 2 warnings, 30 ok"``."""
    n = counts(checks)
    return f"{n[FAIL]} failed, {n[WARN]} warnings, {n[OK]} ok"


def to_json(checks: Iterable[Check]) -> list[dict[str, str]]:
    """The JSON form: one ``{"check", "status", "detail", "fix"}`` object per check, in order."""
    return [c.to_dict() for c in checks]


def status_markup(status: str, label: str | None = None) -> str:
    """The status as rich markup in its colour; ``label`` replaces the word (e.g. "REGRESSION")."""
    return f"[{STYLE[status]}]{label or status}[/]"


@dataclasses.dataclass(frozen=True)
class Column:
    """A table column: ``cell`` turns one row (a Check, or any record a caller tabulates) into its text."""

    header: str
    cell: Callable[[Any], str]
    justify: str = "left"
    overflow: str | None = None
    markup: bool = False  # the cell is rich markup (a status), never escaped


COLUMNS = (
    Column("check", lambda c: c.check),
    Column("status", lambda c: status_markup(c.status), markup=True),
    Column("detail", lambda c: c.detail, overflow="fold"),
    Column("fix", lambda c: c.fix, overflow="fold"),
)


def table(rows: Sequence[Any], title: str, columns: Sequence[Column] = COLUMNS, *, escape: bool = False) -> Table:
    """A rich table of ``rows``, one per check (or record); ``escape``: cells are text, not rich markup."""
    from rich.markup import escape as escape_markup
    from rich.table import Table

    out = Table(title=title)
    for column in columns:
        kwargs = {"overflow": column.overflow} if column.overflow else {}
        out.add_column(column.header, justify=column.justify, **kwargs)
    for row in rows:
        out.add_row(*(c.cell(row) if c.markup or not escape else escape_markup(c.cell(row)) for c in columns))
    return out
