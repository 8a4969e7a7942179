"""What a contract with an upstream source declares, and how a source tree is checked against it.

A contract is one fact verl-npu relies on in code it does not own (MindSpeed, vllm-ascend,
torch-npu): where it lives (a file, and a symbol in it), what we rely on, which of our code relies
on it, the sha256 of that symbol's source at the pinned version, and a few expectations on that
source that say the fact in words a reviewer can check. Standard library only: install.sh runs the
check right after the components are installed, before anything else works.

Locators (how a symbol names a piece of a file):

* ``python``: ``Class.method``, ``function`` or ``Class`` in a Python file (the exact source text);
* ``schema``: an operator's ``func:`` line in torch-npu's native-functions YAML;
* ``op-doc``: the docstring torch-npu registers for an operator (``_add_torch_npu_docstr``);
* ``file``: the whole file;
* ``grep``: every line matching a regular expression in the Python files under a directory (or in
  one file), with its path (for facts of the form "nothing reads X" or "X is defined once").

An expectation is a substring the symbol's source must (or must not) contain, end with or equal;
``ignore_whitespace`` compares both with all whitespace removed, the way verl's GLM-5.2 rollout patch
(verl/utils/vllm/npu_vllm_patch.py) compares the sources it patches.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
import warnings
from pathlib import Path

COMPONENTS = ("mindspeed", "vllm-ascend", "torch-npu", "vllm")
LOCATORS = ("python", "schema", "op-doc", "file", "grep")
MATCHES = ("contains", "ends-with", "equals")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class ContractSpecError(ValueError):
    """A contract declaration is malformed (a bug in verl_npu, caught by the tests)."""


class SymbolNotFound(LookupError):
    """The file exists but the symbol a contract names is not in it."""


def squash(text: str) -> str:
    """``text`` without any whitespace (verl's GLM-5.2 patch normalises the sources it checks this way)."""
    return "".join(text.split())


@dataclasses.dataclass(frozen=True)
class Expect:
    """A substring the symbol's source must (or must not) contain, end with or equal, and the fact that makes
    it matter."""

    text: str
    fact: str
    present: bool = True
    match: str = "contains"  # one of MATCHES
    ignore_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.match not in MATCHES:
            raise ContractSpecError(f"expectation {self.text!r}: match {self.match!r} not in {MATCHES}")

    def holds(self, source: str) -> bool:
        text, source = (squash(self.text), squash(source)) if self.ignore_whitespace else (self.text, source.strip())
        if self.match == "equals":
            found = source == text
        elif self.match == "ends-with":
            found = source.endswith(text)
        else:
            found = text in source
        return found == self.present

    def broken(self) -> str:
        """How a source that breaks this expectation differs, in words."""
        verb = {"contains": "contains", "ends-with": "ends with", "equals": "equals"}[self.match]
        ignoring = " (whitespace ignored)" if self.ignore_whitespace else ""
        return f"{'no longer ' + verb if self.present else 'now ' + verb} {self.text!r}{ignoring}"


@dataclasses.dataclass(frozen=True)
class Contract:
    id: str
    component: str
    path: str  # relative to the component's source root
    locator: str
    symbol: str | None
    line: int  # where the symbol starts at the pinned version (for readers; not checked)
    sha256: str
    relied_on: str
    used_by: str
    expects: tuple[Expect, ...]

    def __post_init__(self) -> None:
        if not _ID_RE.match(self.id):
            raise ContractSpecError(f"contract id {self.id!r} must be lowercase words joined by '-'")
        if self.component not in COMPONENTS:
            raise ContractSpecError(f"contract {self.id}: component {self.component!r} not in {COMPONENTS}")
        if self.locator not in LOCATORS:
            raise ContractSpecError(f"contract {self.id}: locator {self.locator!r} not in {LOCATORS}")
        if (self.symbol is None) != (self.locator == "file"):
            raise ContractSpecError(f"contract {self.id}: a symbol is needed exactly when the locator is not 'file'")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ContractSpecError(f"contract {self.id}: sha256 must be 64 hex characters")
        if not self.expects:
            raise ContractSpecError(f"contract {self.id}: state at least one expectation")
        for text, what in ((self.relied_on, "relied_on"), (self.used_by, "used_by")):
            if not text.strip():
                raise ContractSpecError(f"contract {self.id}: {what} must be stated")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" + (f" ({self.symbol})" if self.symbol else "")


def fingerprint(source: str) -> str:
    """sha256 of a source segment, trailing whitespace of each line ignored."""
    normalised = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha256(normalised.encode()).hexdigest()


# --- locating a symbol ---------------------------------------------------------------------------


def _parse(text: str) -> ast.Module:
    with warnings.catch_warnings():  # upstream files may carry invalid escapes in docstrings
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(text)


def _python_symbol(text: str, symbol: str) -> tuple[str, int]:
    body: list[ast.stmt] = _parse(text).body
    node: ast.AST | None = None
    for part in symbol.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == part
            ),
            None,
        )
        if node is None:
            raise SymbolNotFound(symbol)
        body = getattr(node, "body", [])
    segment = ast.get_source_segment(text, node)
    assert segment is not None and node is not None
    return segment, node.lineno


def _schema_line(text: str, op: str) -> tuple[str, int]:
    pattern = re.compile(rf"^\s*-?\s*func:\s*({re.escape(op)}\(.*)$")
    for number, line in enumerate(text.splitlines(), start=1):
        if match := pattern.match(line):
            return match.group(1), number
    raise SymbolNotFound(op)


def _op_doc(text: str, op: str) -> tuple[str, int]:
    for node in ast.walk(_parse(text)):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "_add_torch_npu_docstr"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == op
            and isinstance(node.args[1], ast.Constant)
        ):
            return str(node.args[1].value), node.lineno
    raise SymbolNotFound(op)


def _grep(root: Path, directory: str, pattern: str) -> tuple[str, int]:
    regex = re.compile(pattern)
    base = root / directory
    if base.is_file():
        paths = [base]
    elif base.is_dir():
        paths = sorted(base.rglob("*.py"))
    else:
        raise FileNotFoundError(base)
    hits = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if regex.search(line):
                hits.append(f"{path.relative_to(root).as_posix()}: {line.strip()}")
    return "\n".join(hits), 0


def read_symbol(root: Path, contract: Contract) -> tuple[str, int]:
    """(source segment, line) of the contract's symbol in the tree at ``root``.

    Raises FileNotFoundError when the file is absent, SymbolNotFound when the symbol is.
    """
    if contract.locator == "grep":
        return _grep(root, contract.path, contract.symbol or "")
    text = (root / contract.path).read_text(errors="replace")
    if contract.locator == "file":
        return text, 1
    if contract.locator == "python":
        return _python_symbol(text, contract.symbol or "")
    if contract.locator == "schema":
        return _schema_line(text, contract.symbol or "")
    return _op_doc(text, contract.symbol or "")
