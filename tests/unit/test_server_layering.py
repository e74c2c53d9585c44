"""The worker's folders, and ``weightwire.core`` below them, are layers: none imports a folder that
imports it back, ``core`` imports nothing of ``server``, and no two modules import each other,
directly or around a circle.

The graph is read from the source with ``ast`` (every ``import`` statement, those inside functions
and under ``TYPE_CHECKING`` included), not from a hand-kept list, so a new module or import is
checked the day it lands. ``from package import module`` counts as an import of that module. A
folder is a directory of modules (``server/rules``); the modules directly in ``server/`` or
``core/`` are that package's own folder.
"""

from __future__ import annotations

import ast
import collections
import pathlib

from import_graph import circles as _circles
from import_graph import graph, modules

_REPO = pathlib.Path(__file__).resolve().parents[2]
_PACKAGES = {"weightwire.server": _REPO / "server", "weightwire.core": _REPO / "core"}
# The one folder loop left, core's own modules <-> core/transports: ``core/manifest.py`` reads the
# transport table (``core/transports/table.py``) for a host worker's transports. Listed so that
# nothing else joins it; the test fails once it is gone, so that this line goes with it.
_KNOWN_FOLDER_EDGES = {("weightwire.core.manifest", "weightwire.core.transports.table")}


def _modules() -> dict[str, pathlib.Path]:
    return modules(_PACKAGES)


def _graph() -> dict[str, set[str]]:
    return graph(_PACKAGES)


def _folder(module: str, mods: dict[str, pathlib.Path]) -> str:
    """The folder a module lives in, as a path (``server/rules``; ``server`` for ``server/cli.py``)."""
    # A package's ``__init__`` lives in the folder it names, as every other module in its own.
    return mods[module].parent.relative_to(_REPO).as_posix()


def _folder_edges(edges: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """folder -> folder it imports -> the module pairs behind that edge (the known one left out)."""
    mods = _modules()
    by_folder: dict[str, dict[str, list[tuple[str, str]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for a, targets in edges.items():
        for b in targets:
            fa, fb = _folder(a, mods), _folder(b, mods)
            if fa != fb and (a, b) not in _KNOWN_FOLDER_EDGES:
                by_folder[fa][fb].append((a, b))
    return by_folder


def test_the_worker_and_core_folders_import_each_other_in_one_direction_only() -> None:
    edges = _graph()
    by_folder = _folder_edges(edges)
    loops = _circles({a: set(bs) for a, bs in by_folder.items()})
    detail = [
        f"{x} -> {y}"
        for loop in loops
        for a in loop
        for b in loop
        if b in by_folder.get(a, {})
        for x, y in by_folder[a][b]
    ]
    assert not loops, f"folders importing each other: {loops}\n" + "\n".join(sorted(detail))
    # The walk saw the layers: the worker above the transports above the rules above core.
    assert {"server/transports", "server/rules", "server/observe", "core"} <= set(by_folder["server/worker"])
    assert {"server/rules", "core/transports"} <= set(by_folder["server/transports"])
    assert {"server/worker", "server/transports"} <= set(by_folder["server/rpc"])
    for a, b in _KNOWN_FOLDER_EDGES:
        assert b in edges[a], f"{a} no longer imports {b}: drop it from _KNOWN_FOLDER_EDGES"


def test_core_imports_nothing_of_the_worker() -> None:
    leaks = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        if a.startswith("weightwire.core")
        for b in targets
        if b.startswith("weightwire.server")
    )
    assert not leaks, leaks


def test_no_module_of_the_worker_or_core_is_part_of_an_import_circle() -> None:
    edges = _graph()
    assert len(edges) >= 60, sorted(edges)
    circles = _circles(edges)
    assert not circles, f"modules importing each other (directly or around a circle): {circles}"


def test_the_walk_finds_a_folder_loop_when_there_is_one() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_worker_asks_importers_and_never_names_a_transport() -> None:
    """How a bucket loads is the importer's to say (its declared abilities): no module of
    ``server/worker/`` compares with a transport's name or handle field, reads a handle field by
    name, or asks ``isinstance`` of an importer class."""
    from weightwire.core.transports import table

    names = {t.name for t in table.TRANSPORTS} | {t.handle_field for t in table.TRANSPORTS}
    importer_classes = {t.importer.rpartition(":")[2] for t in table.TRANSPORTS} | {"PayloadImporter"}
    found = []
    for path in sorted((_REPO / "server" / "worker").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.name}:{node.lineno} names {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr in {
                "TRANSFER_GROUP",
                "CUDA_IPC",
                "HOST_SHM",
                "INLINE",
            }:
                found.append(f"{path.name}:{node.lineno} reads the table row {node.attr}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "isinstance"
                and len(node.args) == 2
            ):
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                for cls in classes:
                    if getattr(cls, "id", getattr(cls, "attr", "")) in importer_classes:
                        found.append(f"{path.name}:{node.lineno} asks isinstance of an importer class")
    assert not found, found
