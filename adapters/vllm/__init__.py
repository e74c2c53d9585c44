"""vLLM adapter: a weightwire worker service inside every vLLM worker.

Engine side: installing weightwire registers the ``weightwire`` weight-transfer backend in vLLM
(``plugin.register``, entry point group ``vllm.general_plugins``); an engine started with
``weight_transfer_config={"backend": "weightwire"}`` then serves each worker's weights at an address
from ``settings`` (docs/vllm.md). Trainer side: ``worker_endpoints(llm)`` (or
``weightwire.adapters.discovery.discover(socket_dir, count=...)``) lists every worker for
``WeightPusher``; ``update_window(llm, version)`` brackets a push with vLLM's
``start_weight_update`` / ``finish_weight_update``.

Importing this package does not import vllm; the backend, adapter and manifest modules do.
"""

from weightwire.adapters.discovery import DiscoveryError, discover
from weightwire.adapters.vllm.plugin import BACKEND_NAME
from weightwire.adapters.vllm.settings import Settings
from weightwire.adapters.vllm.trainer import update_window, worker_endpoints

__all__ = ["BACKEND_NAME", "DiscoveryError", "Settings", "discover", "update_window", "worker_endpoints"]
