"""verl_npu's import graph has no circle (issue 32).

The graph is read from the source with ``ast``, not from a running interpreter: every ``import`` and
``from ... import`` of a verl_npu module counts, wherever it stands (top level, under ``if TYPE_CHECKING:``,
inside a function), so an import moved into a function to dodge a circle is still a circle here. Relative
imports are resolved, ``from pkg import name`` is an edge to ``pkg.name`` when that is a module and to
``pkg`` (its ``__init__``) otherwise, and ``import a.b.c`` is an edge to ``a.b.c`` alone (the packages
above it are loaded first, whatever they import, and an edge to each would make every subpackage that its
own ``__init__`` re-exports a "circle").
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

from support.paths import REPO

PACKAGE = "verl_npu"


def modules(root: Path = REPO / PACKAGE) -> dict[str, Path]:
    """Each module of the package under ``root`` by dotted name (a package's ``__init__`` by the package's)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(target: str, known: Mapping[str, Path]) -> str | None:
    """``target`` if it is a module, else the longest module it is inside (``a.b.Name`` -> ``a.b``)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_resolve(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package.split(".")
                stem = stem[: len(stem) - node.level + 1]
                base = ".".join([*stem, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else _resolve(base, known))
    return {t for t in targets if t is not None and t != name}


def graph(known: Mapping[str, Path]) -> dict[str, set[str]]:
    return {name: imports(name, path, known) for name, path in known.items()}


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``edges`` (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
    return found


def _shortest_path(edges: Mapping[str, Iterable[str]], start: str, end: str, within: set[str]) -> list[str]:
    before = {start: start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == end:
            path = [end]
            while path[-1] != start:
                path.append(before[path[-1]])
            return path[::-1]
        for child in sorted(edges.get(node, ())):
            if child in within and child not in before:
                before[child] = node
                queue.append(child)
    raise AssertionError(f"no path from {start} to {end} inside {sorted(within)}")


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Circles that between them use every edge inside a circle, each as a path that ends where it starts
    (the shortest circle through each such edge, repeats dropped)."""
    found: dict[tuple[str, ...], list[str]] = {}
    for component in strongly_connected(edges):
        within = set(component)
        if len(component) == 1 and component[0] not in edges.get(component[0], ()):
            continue
        for source in component:
            for target in sorted(set(edges.get(source, ())) & within):
                loop = [source, *_shortest_path(edges, target, source, within)]
                body = loop[:-1]
                turn = body.index(min(body))
                key = tuple(body[turn:] + body[:turn])
                found.setdefault(key, [*key, key[0]])
    return sorted(found.values(), key=lambda c: (len(c), c))


def test_the_cycle_finder_finds_each_circle_of_a_toy_graph_and_nothing_else():
    edges = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),  # d, e: no circle
        "f": {"f"},  # a module importing itself
        "g": {"h"},
        "h": {"g", "i"},  # g <-> h
        "i": {"g"},  # g -> h -> i -> g, sharing g -> h with the one above
    }
    assert sorted(strongly_connected(edges)) == [["a", "b", "c"], ["d"], ["e"], ["f"], ["g", "h", "i"]]
    assert cycles(edges) == [["f", "f"], ["g", "h", "g"], ["a", "b", "c", "a"], ["g", "h", "i", "g"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({}) == []


def test_the_import_reader_resolves_relative_submodule_and_name_imports(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from pkg.sub import helper, NAME\n")
    (root / "sub" / "__init__.py").write_text("NAME = 1\n")
    (root / "sub" / "helper.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import NAME\n"
        "if TYPE_CHECKING:\n"
        "    from ..other import Thing\n"
        "def late():\n"
        "    import pkg.sub.deep\n"
        "    from .. import other\n"
    )
    (root / "sub" / "deep.py").write_text("import os\nimport pkg\n")
    (root / "other.py").write_text("from .sub.helper import late\n")
    known = modules(root)
    assert sorted(known) == ["pkg", "pkg.other", "pkg.sub", "pkg.sub.deep", "pkg.sub.helper"]
    assert graph(known) == {
        "pkg": {"pkg.sub", "pkg.sub.helper"},
        "pkg.sub": set(),
        "pkg.sub.helper": {"pkg.sub", "pkg.other", "pkg.sub.deep"},
        "pkg.sub.deep": {"pkg"},
        "pkg.other": {"pkg.sub.helper"},
    }
    assert cycles(graph(known)) == [
        ["pkg.other", "pkg.sub.helper", "pkg.other"],
        ["pkg", "pkg.sub.helper", "pkg.sub.deep", "pkg"],
    ]


def test_verl_npu_has_no_import_circle():
    found = cycles(graph(modules()))
    assert not found, f"{len(found)} import circle(s) in {PACKAGE}:\n" + "\n".join(" -> ".join(c) for c in found)
