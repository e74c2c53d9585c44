"""Reliability and security tests: real worker processes killed mid-update, hostile messages, load,
tokens and TLS. ``python -m tests.reliability.load`` runs the load test as a script.

``tests/helpers.py`` (the shared test helpers) is re-exported here as ``helpers``, so these modules
find it both under pytest and when run with ``python -m``.
"""

from __future__ import annotations

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import helpers  # noqa: E402

__all__ = ["helpers"]
