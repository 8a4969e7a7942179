"""verl_npu.ops is the bottom layer: pure functions and kernels, no import cycle, nothing from the engine.

The check reads the import graph from the source (imports inside functions included): the ops
import each other lazily, so an import cycle between them would not fail at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO

OPS = REPO / "verl_npu" / "ops"
ABOVE = ("verl_npu.engine", "verl_npu.runtime_patches", "verl_npu.patching")  # what builds on the ops


def _imports(path: Path) -> set[str]:
    """The verl_npu modules ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("verl_npu")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_npu"):
            # `from verl_npu.ops import ascend` imports the module verl_npu.ops.ascend
            found |= {f"{node.module}.{a.name}" if node.module == "verl_npu.ops" else node.module for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    return {f"verl_npu.ops.{p.stem}": _imports(p) for p in sorted(OPS.glob("*.py")) if p.stem != "__init__"}


def test_ops_import_nothing_from_the_engine_or_the_patches():
    for module, imports in _graph().items():
        above = {
            m for m in imports if m.startswith(("verl_npu.engine", "verl_npu.runtime_patches", "verl_npu.patching"))
        }
        assert not above, f"{module} imports {sorted(above)}: the module classes live in verl_npu.engine"


def test_the_ops_import_graph_has_no_cycle():
    graph = {m: {i for i in imports if i.startswith("verl_npu.ops.")} for m, imports in _graph().items()}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join((*path[path.index(module) :], module)))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
