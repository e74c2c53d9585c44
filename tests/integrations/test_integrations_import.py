"""The framework glue is optional: importing weightwire, its client, server or adapters loads neither
weightwire.integrations nor TRL nor verl (an engine's or trainer's environment without them works,
and one with them pays nothing for it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["weightwire", "weightwire.client", "weightwire.server", "weightwire.adapters.torch"]


@pytest.mark.parametrize("module", CORE)
def test_the_core_does_not_import_the_integrations(module: str) -> None:
    # A fresh interpreter: this test process may have imported anything already. Touching the
    # client's lazy names loads the pusher (and torch), which is where a stray import would be.
    code = (
        "import sys, importlib\n"
        f"m = importlib.import_module({module!r})\n"
        "if hasattr(m, 'WeightPusher'): m.WeightPusher, m.PushError, m.TransferGroupOptions\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('trl', 'verl', 'ray')"
        " or n.startswith('weightwire.integrations')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
