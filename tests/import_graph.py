"""The import graph of weightwire's packages, read from the source with ``ast`` (every ``import``
statement, those inside functions and under ``TYPE_CHECKING`` included), and the circles in a graph.
Shared by the layering tests of the client (tests/unit/test_client_layering.py) and of the worker and
core (tests/unit/test_server_layering.py). ``from package import module`` counts as an import of that
module."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Mapping


def modules(packages: Mapping[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Every module of ``packages`` (import name of a package -> its folder), by import name."""
    mods = {}
    for root, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([root, *parts])] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: Mapping[str, pathlib.Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in mods else source)
    return {m for m in found if m in mods and m != name}


def graph(packages: Mapping[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports."""
    mods = modules(packages)
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
