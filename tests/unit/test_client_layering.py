"""The trainer's folders are layers: none imports a folder that imports it back, and no two modules
of ``weightwire.client`` import each other, directly or around a circle.

The graph is read from the source (every ``import`` statement, those inside functions and under
``TYPE_CHECKING`` included), not from a hand-kept list, so a new module or import is checked the day
it lands. ``from package import module`` counts as an import of that module.
"""

from __future__ import annotations

import collections
import pathlib

from import_graph import circles as _circles
from import_graph import graph

_CLIENT = pathlib.Path(__file__).resolve().parents[2] / "client"
_ROOT = "weightwire.client"


def _graph() -> dict[str, set[str]]:
    return graph({_ROOT: _CLIENT})


def _folder(module: str) -> str:
    """The folder a module lives in (``push`` for ``weightwire.client.push.pusher``); the
    package's own ``__init__`` and any module directly in ``client/`` are the folder ``.``."""
    rest = module[len(_ROOT) + 1 :].split(".") if module != _ROOT else []
    return rest[0] if len(rest) > 1 or (rest and (_CLIENT / rest[0]).is_dir()) else "."


def _folder_edges(edges: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """folder -> folder it imports -> the module pairs behind that edge."""
    by_folder: dict[str, dict[str, list[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for a, targets in edges.items():
        for b in targets:
            if _folder(a) != _folder(b):
                by_folder[_folder(a)][_folder(b)].append(f"{a} -> {b}")
    return by_folder


def test_the_client_folders_import_each_other_in_one_direction_only() -> None:
    by_folder = _folder_edges(_graph())
    loops = _circles({a: set(bs) for a, bs in by_folder.items()})
    detail = [
        pair
        for loop in loops
        for a in loop
        for b in loop
        if b in by_folder.get(a, {})
        for pair in by_folder[a][b]
    ]
    assert not loops, f"folders importing each other: {loops}\n" + "\n".join(sorted(detail))
    # The walk saw the layers: the pusher above the ranks above one update above the transports.
    assert {"ranks", "update", "transports", "inputs"} <= set(by_folder["push"])
    assert {"update", "transports"} <= set(by_folder["ranks"])


def test_no_module_of_the_client_is_part_of_an_import_circle() -> None:
    edges = _graph()
    assert len(edges) >= 40, sorted(edges)
    circles = _circles(edges)
    assert not circles, f"modules importing each other (directly or around a circle): {circles}"


def test_the_walk_finds_a_circle_when_there_is_one() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
