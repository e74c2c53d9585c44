"""The ``weightwire`` command line: the entry point (``main``), the client's subcommands, the progress bar, the live fleet view and the demo."""

from weightwire.client.cli.main import main

__all__ = ["main"]
