"""SGLang adapter: a weightwire worker service inside every SGLang scheduler process.

Engine side: installing ``weightwire[sglang]`` registers the plugin (``plugin.register``, entry
point group ``sglang.srt.plugins``); each scheduler process then serves its rank's weights at an
address from ``settings`` (docs/sglang.md). Trainer side: ``discover(socket_dir)`` (or
``discover(base_address=..., count=...)``) lists every worker of an engine for ``WeightPusher``.

Importing this package does not import sglang; the plugin, adapter and manifest modules do.
"""

from weightwire.adapters.sglang.discovery import DiscoveryError, discover
from weightwire.adapters.sglang.settings import Settings, worker_id

__all__ = ["DiscoveryError", "Settings", "discover", "worker_id"]
