"""tests/integrations: the framework glue (weightwire.integrations) driven by the frameworks' own code.

Each module runs in the environment that has what it needs: TRL with a real vLLM server in
``.venv-vllm`` (``make install-vllm`` adds TRL), the TRL backend into a real SGLang server and verl in
``.venv`` (``make install-sglang``, ``make install-verl``). Elsewhere those modules are not
collected; the import-isolation test runs everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _installed(name: str) -> bool:
    # tests/ is on sys.path (tests/conftest.py): without the real package its tests/<name> folder
    # would be found as a namespace package (no origin).
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
collect_ignore_glob = []
if _installed("vllm") and _installed("trl"):
    # The vLLM CPU engine helpers (vllm_cpu, engine_checks) live with the vLLM tests.
    sys.path.insert(0, os.path.join(TESTS, "vllm"))
else:
    collect_ignore_glob.append("test_trl_vllm_*.py")
if _installed("sglang"):
    # The SGLang CPU engine helpers (checkpoints, real_engine) live with the SGLang tests.
    sys.path.insert(0, os.path.join(TESTS, "sglang"))
else:
    collect_ignore_glob.append("test_trl_sglang_*.py")
if not _installed("verl"):
    collect_ignore_glob.append("test_verl_*.py")
