"""The ``weightwire`` command line: the entry point (``weightwire.client.cli.main.main``), the
client's subcommands, the progress bar, the live fleet view and the demo.

Nothing is imported here: the workers run as ``python -m weightwire.client.cli.main serve``, and
a package that imported its ``main`` module first would make runpy warn on every start.
"""
