"""Hooks of the reliability tests: slow tests run only when asked for, and the closing summary says
how many hostile cases ran and what the load runs measured."""

from __future__ import annotations

import os
import pathlib

import pytest

from .common import CASES_RUN, LOAD_REPORTS

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` tests here (the 16-worker load run) are skipped unless selected with `-m slow` (or
    any -m expression naming it) or WEIGHTWIRE_SLOW=1; CI runs the short versions only."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("WEIGHTWIRE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with `-m slow` or WEIGHTWIRE_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") and _HERE in item.path.parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES_RUN:
        total = sum(CASES_RUN.values())
        terminalreporter.write_line(
            f"weightwire adversarial: {total} hostile streams/messages ran ({len(CASES_RUN)} kinds)"
        )
    for line in LOAD_REPORTS:
        terminalreporter.write_line(f"weightwire load: {line}")
