"""Find every weightwire worker of one SGLang engine, from the trainer side.

The plugin puts each scheduler process's worker where ``weightwire.adapters.endpoints`` says
(``$WEIGHTWIRE_SGLANG_SOCKET_DIR/<worker_id>.sock`` or ``HOST:WEIGHTWIRE_SGLANG_BASE_PORT + index``),
the same layout every engine adapter uses, so discovery is the engine-neutral one; this module keeps
the names SGLang users import.
"""

from __future__ import annotations

from weightwire.adapters.discovery import DiscoveryError, discover
from weightwire.adapters.endpoints import unix_socket_alive

__all__ = ["DiscoveryError", "discover", "unix_socket_alive"]
