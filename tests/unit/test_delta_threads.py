"""The thread count of a delta's host work: the usable cores up to a cap, or the environment's."""

from __future__ import annotations

import logging
import os

import pytest
from weightwire.core.delta import threads


def test_the_default_is_the_usable_cores_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.DELTA_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert threads.delta_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)))
    assert threads.delta_threads() == threads.MAX_DELTA_THREADS


def test_the_environment_sets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(threads.DELTA_THREADS_ENV, "1")
    assert threads.delta_threads() == 1
    monkeypatch.setenv(threads.DELTA_THREADS_ENV, " 12 ")
    assert threads.delta_threads() == 12
    monkeypatch.setenv(threads.DELTA_THREADS_ENV, "100000")
    assert threads.delta_threads() == 64


@pytest.mark.parametrize("raw", ["0", "-3", "two", "1.5"])
def test_a_bad_value_is_logged_and_the_default_used(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(threads.DELTA_THREADS_ENV, raw)
    threads._ignored.cache_clear()
    with caplog.at_level(logging.WARNING, logger=threads.__name__):
        assert threads.delta_threads() == threads.MAX_DELTA_THREADS
    assert f"{threads.DELTA_THREADS_ENV}={raw!r}" in caplog.text
