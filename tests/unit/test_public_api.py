"""The public names the docs tell users to import resolve from ``weightwire.client`` (the tree behind
them may move; these may not)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import weightwire.client as client

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves() -> None:
    for name in client.__all__:
        assert getattr(client, name) is not None, name


def test_the_docs_import_client_names_from_the_package() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        for module, names in re.findall(r"from (weightwire\.[\w.]+) import ([\w, ]+)", doc.read_text()):
            if module.startswith("weightwire.client."):
                raise AssertionError(f"{doc.name} imports {names} from {module}; use weightwire.client")
            mod = importlib.import_module(module)
            for name in (n.strip().split(" as ")[0] for n in names.split(",")):
                found = hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None
                assert found, f"{doc.name}: {module} has no {name}"
