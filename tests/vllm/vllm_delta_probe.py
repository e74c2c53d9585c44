"""Test-only worker extension: where weightwire's vLLM adapter holds each layer's delta base, and a
write behind its back (a drift the next delta's result checksum must catch), in the worker process
(``LLM.collective_rpc("weightwire_delta_bases")``, ``("weightwire_drift", args=(name,))``)."""

from __future__ import annotations

import torch
from vllm_sleep_probe import SleepProbe


class DeltaProbe(SleepProbe):
    """Mixed into each vLLM worker (vLLM's worker-extension mechanism); sleeps and wakes as ``SleepProbe``."""

    def weightwire_delta_bases(self) -> dict[str, str | None]:
        """Per vLLM layer: 'model', 'copy' or None (``LayerBases.where``)."""
        adapter = self.weight_transfer_engine.adapter
        return {layer: adapter.bases.where(layer) for layer in adapter.layout.names_by_layer}

    def weightwire_drift(self, name: str) -> None:
        """Flip the lowest bit of the first element of this rank's piece of ``name`` where its base is,
        outside any update (what another writer into the engine's weights would do)."""
        from weightwire.core.delta.record import as_bits

        base = self.weight_transfer_engine.adapter.bases.base_of(name)
        with torch.no_grad():
            as_bits(base).view(-1)[0] ^= 1
