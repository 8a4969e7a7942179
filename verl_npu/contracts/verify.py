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
