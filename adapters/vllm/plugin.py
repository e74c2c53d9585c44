"""vLLM plugin: registers the ``weightwire`` weight-transfer backend in every vLLM process.

Entry point ``weightwire`` in group ``vllm.general_plugins`` (pyproject.toml). vLLM calls
``register()`` from ``load_general_plugins()`` in each of its processes (the API server or driver,
the engine core, and every worker before its model is built). Registration is by module path, so
nothing of weightwire's server side is imported until a worker builds the backend, and only in an
engine started with ``weight_transfer_config={"backend": "weightwire"}``: installing weightwire
changes nothing in engines that do not ask for it.
"""

from __future__ import annotations

import logging

# Under "vllm." so that vLLM's own log configuration prints it in every worker process.
log = logging.getLogger("vllm.weightwire")

TESTED_VLLM_VERSION = "0.32.0"
BACKEND_NAME = "weightwire"
_BACKEND_MODULE = "weightwire.adapters.vllm.backend"
_BACKEND_CLASS = "WeightwireWeightTransferEngine"


def register() -> None:
    """Entry point called by vLLM's ``load_general_plugins()``; safe to call more than once."""
    import vllm
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _BACKEND_MODULE, _BACKEND_CLASS)
    except ValueError:
        # Already registered in this process (the registry refuses a second registration).
        return
    if not str(vllm.__version__).startswith(TESTED_VLLM_VERSION):
        log.warning(
            "weightwire: registered weight-transfer backend %r for vLLM %s; this weightwire was validated with vLLM %s",
            BACKEND_NAME, vllm.__version__, TESTED_VLLM_VERSION,
        )
