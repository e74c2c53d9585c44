"""Test-only worker extension: what weightwire's vLLM adapter decided about direct copies, read in
the worker process (``LLM.collective_rpc("weightwire_direct")``)."""

from __future__ import annotations

from typing import Any


class DirectProbe:
    """Mixed into each vLLM worker (vLLM's worker-extension mechanism)."""

    weight_transfer_engine: Any

    def weightwire_direct(self) -> dict[str, Any]:
        direct = self.weight_transfer_engine.adapter.direct
        return {"proven": sorted(direct.proven), "refused": dict(direct.refused), "copied": direct.copied}
