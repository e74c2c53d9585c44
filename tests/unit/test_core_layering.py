"""Only ``weightwire.server.rpc`` (and the ``serve`` command that starts it) imports gRPC on the worker.

The rule is checked by folder, not by a hand-kept list: every module of ``weightwire.core`` and of
``weightwire.server`` outside ``rpc/`` is imported in a fresh interpreter, and none may pull in grpc.
"""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import importlib, pkgutil, sys
import weightwire.core, weightwire.server
grpc_allowed = ("weightwire.server.rpc", "weightwire.server.cli")
imported = []
for pkg in (weightwire.core, weightwire.server):
    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if mod.name.startswith(grpc_allowed):
            continue
        importlib.import_module(mod.name)
        imported.append(mod.name)
        leaked = sorted(m for m in sys.modules if m == "grpc" or m.startswith(("grpc.", "grpc_")))
        if leaked:
            print("LEAK", mod.name, leaked[:3])
            raise SystemExit(1)
print(len(imported))
"""


def test_worker_core_does_not_import_grpc() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # the walk really covered the tree (core, worker, rules, transports, observe)
    assert int(out.stdout.strip()) >= 30


def test_rpc_is_the_only_server_folder_importing_grpc() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, weightwire.server.rpc.servicer; print('grpc' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr
