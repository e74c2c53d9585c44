"""vLLM plugin: registers the ``weightwire`` weight-transfer backend in every vLLM process.

Entry point ``weightwire`` in group ``vllm.general_plugins`` (pyproject.toml). vLLM calls
``register()`` from ``load_general_plugins()`` in each of its processes (the API server or driver,
the engine core, and every worker before its model is built). Registration is by module path, so
nothing of weightwire's server side is imported until a worker builds the backend, and only in an
engine started with ``weight_transfer_config={"backend": "weightwire"}``: installing weightwire
changes nothing in engines that do not ask for it.

Releases: vLLM 0.26 through 0.33 (``SUPPORTED_RANGE``). The hooks the backend uses were read in each
of those releases (the ``WeightTransferEngine`` base and factory, the worker's weight-update calls,
``vllm.model_executor.model_loader.reload`` and the parallel layers the manifest reads); where they
differ the code goes by feature, not by version number. A worker of an engine that asked for the
backend refuses any other release at start-up (``check_version``), naming the range; here, at
registration, it only warns, so that installing weightwire never stops an engine that does not use it.
"""

from __future__ import annotations

import logging
import os
import re

# Under "vllm." so that vLLM's own log configuration prints it in every worker process.
log = logging.getLogger("vllm.weightwire")

# The oldest and newest minor releases whose hooks the backend was checked against (docs/vllm.md
# says which of them ran where).
OLDEST_VLLM = (0, 26)
NEWEST_VLLM = (0, 33)
SUPPORTED_RANGE = "0.26 through 0.33"
ENV_ALLOW_UNTESTED = "WEIGHTWIRE_VLLM_ALLOW_UNTESTED"
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
    if not version_supported(str(vllm.__version__)):
        log.warning(
            "weightwire: registered weight-transfer backend %r in vLLM %s, outside the releases it supports (%s); "
            "an engine that selects it will refuse to start unless %s=1",
            BACKEND_NAME,
            vllm.__version__,
            SUPPORTED_RANGE,
            ENV_ALLOW_UNTESTED,
        )


def version_supported(version: str) -> bool:
    """``0.26.0`` .. ``0.33.x``, including local builds such as ``0.32.0+cpu``."""
    m = re.match(r"^(\d+)\.(\d+)\.", version)
    return m is not None and OLDEST_VLLM <= (int(m.group(1)), int(m.group(2))) <= NEWEST_VLLM


def check_version(version: str, env: dict[str, str] | None = None) -> None:
    """Refuse (RuntimeError, which stops the engine's start-up) a vLLM release outside the range,
    unless ``WEIGHTWIRE_VLLM_ALLOW_UNTESTED=1``."""
    if version_supported(version):
        return
    msg = (
        f"weightwire: vLLM {version} is outside the releases this weightwire supports ({SUPPORTED_RANGE}); "
        f"install one of those, set {ENV_ALLOW_UNTESTED}=1 to try this one anyway, or start the engine "
        "without weight_transfer_config backend 'weightwire'"
    )
    if (os.environ if env is None else env).get(ENV_ALLOW_UNTESTED) == "1":
        log.warning("%s. Continuing: %s=1.", msg, ENV_ALLOW_UNTESTED)
        return
    raise RuntimeError(msg)
