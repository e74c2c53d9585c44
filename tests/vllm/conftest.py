"""tests/vllm runs a real vLLM engine: only in an environment that has vllm (`.venv-vllm`, built by
`make install-vllm`; `make test` runs these tests there). Elsewhere nothing here is collected."""

from __future__ import annotations

import importlib.util


def _vllm_installed() -> bool:
    # tests/ is on sys.path (tests/conftest.py), so without a real vllm this very directory would be
    # found as a namespace package named "vllm" (no origin); the real one is a regular package.
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


collect_ignore_glob = [] if _vllm_installed() else ["test_*.py"]
