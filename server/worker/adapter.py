"""The engine adapter interface: what the worker service needs from an inference engine.

The service (``weightwire.server``) owns identity, selection, validation and the update state
machine; an adapter only describes what its engine owns and copies tensors in. Implementations:
``weightwire.adapters.torch.TorchAdapter`` (any nn.Module) and
``weightwire.adapters.sglang`` (a scheduler process of SGLang).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from weightwire.core.delta import Delta
from weightwire.core.manifest import ShardManifest

# Declared beside the views it prepares loads of (the rules sit below the worker); named here too,
# with the adapter's other optional abilities.
from weightwire.server.rules.views import PreparesLoads

__all__ = ["AppliesDeltas", "EngineAdapter", "KeepsTensors", "KeptPart", "PreparesLoads", "TracksWrites"]

# One part of a checkpoint tensor a worker keeps: (dim, offset, length) of its manifest's
# ``OwnedTensor.pieces`` (None: the whole tensor), and the live tensor that holds it.
KeptPart = tuple[tuple[int, int, int] | None, torch.Tensor]


@runtime_checkable
class EngineAdapter(Protocol):
    """Engine glue, called by the worker service on its update thread, one update at a time."""

    def manifest(self) -> ShardManifest:
        """Device, ranks and every checkpoint tensor this worker consumes (full checkpoint dtype and
        shape). Called once at start and again for each GetManifest; must be stable while the
        engine runs."""
        ...

    def begin_update(self, version: int) -> None:
        """Called after a header was accepted, before the first load (e.g. SGLang's
        begin_weight_update)."""
        ...

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy these full checkpoint tensors into the model (slicing its own TP part).

        The tensors are read-only views into the sender's buffer, valid only during this call: the
        adapter must copy, and the copy must have finished on the device when it returns (the
        service acks the bucket right after). Names are validated against ``manifest()`` already.

        An adapter may also be ``PreparesLoads``: for views a kept mapping serves again in
        later updates, the service then prepares once and only calls the prepared load after that.
        """
        ...

    def end_update(self, success: bool) -> None:
        """Called once after commit (success) or after a failed/cancelled update (e.g. SGLang's
        end_weight_update, which post-processes quantised weights)."""
        ...

    # A typed ``WeightwireError`` raised by ``end_update(True)`` reaches the client as it is.


@runtime_checkable
class TracksWrites(Protocol):
    """An adapter that holds tensors back until it can apply them (vLLM reloads a fused layer only
    whole), and so knows whether an update changed the model. Without it every load counts as a
    write; with it an update refused before anything was written leaves the worker CONSISTENT."""

    def touched_model(self) -> bool:
        """Whether the current (or, once it ended, the last) update changed the model."""
        ...


@runtime_checkable
class KeepsTensors(Protocol):
    """An adapter whose model holds what it keeps of each owned tensor as one tensor that bytes
    may be written into directly: the pieces its manifest lists, concatenated along their dimension
    in manifest order (the whole tensor when it lists none). An update whose every trainer rank is
    a source (``TRANSFER_MODE_SLICES``) receives straight into these; the worker then publishes
    ``ShardManifest.receives_slices``."""

    def kept_tensors(self) -> Mapping[str, torch.Tensor]:
        """The kept tensor of every owned tensor, by checkpoint name (live, stable while the engine runs)."""
        ...


@runtime_checkable
class AppliesDeltas(Protocol):
    """An adapter that applies a delta update's changes in place (``UpdateHeader.delta_base``).
    Without it the worker refuses a delta update at its header (DELTA_BASE_MISMATCH, metadata
    ``applies_deltas`` false), before anything is written, and the trainer sends it whole."""

    def apply_deltas(self, deltas: Sequence[tuple[str, Delta]]) -> None:
        """Write each delta into what this worker keeps of its checkpoint tensor, in place.

        A ``Delta`` addresses the full checkpoint tensor's row-major elements (the manifest's dtype
        and shape); an adapter that keeps pieces writes the changes that fall in each. The service
        has checked every delta of the call against that full tensor (``check_delta``) before the
        call; its views are valid only during the call, and the writes must have finished on the
        device when it returns (the result is verified right after)."""
        ...

    def delta_parts(self, name: str) -> Sequence[KeptPart]:
        """What this worker keeps of ``name`` after applying: one entry per manifest piece (or one
        for the whole tensor), each piece's elements in row-major order as the trainer's checksum
        reads them."""
        ...
