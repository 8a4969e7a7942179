"""Check the recorded contracts against real upstream sources: a checkout, an unpacked wheel or sdist,
or what is installed in this Python (located without importing it: importing MindSpeed patches
megatron, importing torch_npu needs CANN, importing vllm_ascend imports torch_npu).

Standard library only, so install.sh can run it right after installing the components.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path

from verl_npu.contracts.spec import COMPONENTS, Contract, SymbolNotFound, fingerprint, read_symbol
from verl_npu.errors import UserError

OK, DRIFTED, MISSING, NOT_FOUND = "ok", "drifted", "missing", "not-found"
# the import package that locates each component's source root (its parent directory)
IMPORT_NAMES = {"mindspeed": "mindspeed", "vllm-ascend": "vllm_ascend", "torch-npu": "torch_npu", "vllm": "vllm"}


@dataclasses.dataclass(frozen=True)
class Result:
    contract: Contract
    status: str
    detail: str
    found_sha256: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return {
            "id": self.contract.id,
            "component": self.contract.component,
            "where": self.contract.where,
            "status": self.status,
            "detail": self.detail,
            "expected_sha256": self.contract.sha256,
            "found_sha256": self.found_sha256,
        }


def installed_root(component: str) -> Path | None:
    """The directory holding the component's import package in this Python, without importing it."""
    try:
        spec = importlib.util.find_spec(IMPORT_NAMES[component])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def check(contract: Contract, root: Path) -> Result:
    try:
        source, _ = read_symbol(root, contract)
    except FileNotFoundError:
        return Result(contract, MISSING, f"{contract.path} is not in {root}")
    except SymbolNotFound:
        return Result(contract, MISSING, f"{contract.symbol} is no longer in {contract.path}")
    except (OSError, SyntaxError, UnicodeError) as exc:
        return Result(contract, MISSING, f"{contract.path} could not be read: {exc}")
    found = fingerprint(source)
    broken = [e for e in contract.expects if not e.holds(source)]
    if found == contract.sha256 and not broken:
        return Result(contract, OK, contract.relied_on, found)
    if broken:
        facts = "; ".join(f"{e.fact}: {e.broken()}" for e in broken)
        return Result(contract, DRIFTED, f"changed, and these facts no longer hold: {facts}", found)
    return Result(
        contract,
        DRIFTED,
        f"changed (sha256 {found[:12]}, recorded {contract.sha256[:12]}); the recorded facts still read true, "
        f"but review the change against: {contract.relied_on}; then record the new sha256",
        found,
    )


def verify(
    contracts: Iterable[Contract], sources: Mapping[str, Path | None], *, components: Iterable[str] = COMPONENTS
) -> list[Result]:
    """Every contract of ``components`` checked against ``sources`` (component -> source root).

    A component without a source root gives NOT_FOUND results, never a silent pass.
    """
    wanted = set(components)
    results = []
    for contract in contracts:
        if contract.component not in wanted:
            continue
        root = sources.get(contract.component)
        if root is None or not Path(root).is_dir():
            where = f"{root} is not a directory" if root is not None else "it is not installed in this Python"
            results.append(Result(contract, NOT_FOUND, f"{contract.component}: {where}"))
            continue
        results.append(check(contract, Path(root)))
    return results


def sources_for(overrides: Mapping[str, Path], components: Iterable[str] = COMPONENTS) -> dict[str, Path | None]:
    """Each component's source root: the override given, else the installed package's."""
    return {c: overrides[c] if c in overrides else installed_root(c) for c in components}


def source_overrides(
    items: Iterable[str], contracts: Iterable[Contract], components: Iterable[str] = COMPONENTS
) -> dict[str, Path]:
    """``--source NAME=DIR`` options as component -> directory; UserError (exit 2, nothing verified) for an unknown
    or repeated NAME, one outside ``components``, or a DIR that is missing, not a directory, or holds none of the
    files the component's contracts read: a wrong path, which verifying would report as upstream drift."""
    wanted = list(components)
    contracts = list(contracts)
    overrides: dict[str, Path] = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep or name not in COMPONENTS:
            raise UserError(f"--source {item!r}: expected NAME=DIR with NAME one of {', '.join(COMPONENTS)}")
        if name in overrides:
            raise UserError(f"--source {name} is given twice ({overrides[name]}, then {directory!r}): give it once")
        if name not in wanted:
            raise UserError(f"--source {item!r}: {name} is not among the components checked ({', '.join(wanted)})")
        root = Path(directory)
        if not directory:
            raise UserError(f"--source {item!r}: DIR is empty; give the {name} source tree")
        if not root.exists():
            raise UserError(f"--source {item!r}: {directory} does not exist")
        if not root.is_dir():
            raise UserError(f"--source {item!r}: {directory} is not a directory")
        paths = sorted({c.path for c in contracts if c.component == name})
        if paths and not any((root / path).exists() for path in paths):
            package = IMPORT_NAMES[name]
            hint = (
                f"; {directory} looks like the {package} package itself: give its parent directory"
                if root.resolve().name == package
                else ""
            )
            example = max(paths, key=len)
            raise UserError(
                f"--source {item!r}: none of the {len(paths)} files the {name} contracts read is in {directory} "
                f"(such as {example}): give the directory that holds the {package}/ package (a checkout's root, an "
                f"unpacked wheel or sdist){hint}"
            )
        overrides[name] = root
    return overrides
