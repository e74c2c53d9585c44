"""The worker core stays free of gRPC: only the servicer and serve() import it."""

from __future__ import annotations

import subprocess
import sys


def test_worker_core_does_not_import_grpc() -> None:
    code = (
        "import sys\n"
        "import weightwire.server.worker.service, weightwire.server.rules.selection, weightwire.server.rules.validation\n"
        "import weightwire.adapters.torch.demo\n"
        "from weightwire.server.transports.importer import make_importers\n"
        "make_importers()\n"
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.') or m.startswith('grpc_')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
