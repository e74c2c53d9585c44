"""Fixtures of the reliability tests, and a closing line with how many hostile cases ran."""

from __future__ import annotations

import pytest

from .common import CASES_RUN


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES_RUN:
        total = sum(CASES_RUN.values())
        kinds = len(CASES_RUN)
        terminalreporter.write_line(f"weightwire adversarial: {total} hostile streams/messages ran ({kinds} kinds)")
