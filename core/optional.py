"""Loading an optional part of weightwire by name, for the parts a process may not have installed
(a transport's exporter or importer, a command-line subcommand of an extra)."""

from __future__ import annotations

import importlib


def load_optional(ref: str) -> object | None:
    """The object ``"module:attr"`` names, or None when that module itself is not installed here
    (a missing dependency inside it still raises, so a broken part is never silently absent)."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return None
    return getattr(module, attr)


__all__ = ["load_optional"]
