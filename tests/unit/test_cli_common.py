"""``weightwire.core.cli_common``: a subcommand's help opens with its run function's docstring, one
without a docstring is refused when registered, and a refusal is one line with exit status 2."""

from __future__ import annotations

import argparse

import pytest
from weightwire.core import cli_common


def _run(args: argparse.Namespace) -> int:
    """Do the thing, once."""
    return 0


def test_a_command_is_described_by_its_run_function() -> None:
    sub = argparse.ArgumentParser(prog="weightwire").add_subparsers()
    p = cli_common.add_command(sub, "thing", _run, "do the thing")
    assert p.description == "Do the thing, once."
    assert p.parse_args([]).func is _run


def test_a_run_function_without_a_docstring_is_refused() -> None:
    sub = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(TypeError, match="no docstring"):
        cli_common.add_command(sub, "thing", lambda args: 0, "do the thing")


def test_a_refusal_is_one_line_and_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_common.refuse("weightwire serve", "no such device") == 2
    assert capsys.readouterr().err == "weightwire serve: no such device\n"
