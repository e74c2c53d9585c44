"""tests/vllm runs a real vLLM engine: only in an environment that has vllm (`.venv-vllm`, built by
`make install-vllm`; `make test` runs these tests there). Elsewhere nothing here is collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
