"""A delta update of a planned fleet, predicted next to its FULL update (``weightwire plan
--changed-fraction``, or the description's ``delta`` table). Pure: no I/O.

What is predicted: every region of the plan (one ``Transfer``, a box of one tensor from one trainer
rank) has the same fraction of its elements changed since the base, rounded to a whole element, and
travels in the encoding the trainer would choose at that density, encoded on its own as every
region of an every-rank-a-source update carries its own ``TensorDelta``. The encoding and its bytes
come from ``core.delta.encoding`` (``choose_encoding``, ``encoded_size_bytes``), the rule the
trainer's ``encode`` applies, so the planner cannot drift from what would be sent. Those bytes are
then timed by the FULL prediction's own model (``transfer_plan_fleet.predict``: busiest port, bytes
/ bandwidth + buckets x per-message latency), so the two predictions differ only in the bytes.

What is not: how many elements a real step changes (measured per model and learning rate, not
known here), how they cluster (a tensor that changes more than the average tips into another
encoding), and the costs a delta adds off the wire: the trainer's diff against its base, the
checksums on both sides and the worker's apply (BENCHMARKS.md "Deltas" measures them).

``client/cli/plan.py`` calls ``predict_delta``, importing this module only when a fraction is
given: ``core.delta`` imports torch, which a FULL plan does without.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from weightwire.core.delta.encoding import Encoding, choose_encoding, encoded_size_bytes
from weightwire.core.transports.transfer_plan import Transfer, box_elements
from weightwire.core.transports.transfer_plan_fleet import (
    FleetPlan,
    Prediction,
    checked_changed_fraction,
    predict,
)

__all__ = [
    "DELTA_MODEL_STATEMENT",
    "DeltaPrediction",
    "EncodingShare",
    "predict_delta",
    "region_encoding",
]

DELTA_MODEL_STATEMENT = (
    "the FULL update's model, over the bytes each region of the plan takes as a delta: the changed "
    "fraction of its elements (rounded to a whole element, the same fraction in every region), in the "
    "encoding the trainer chooses at that density (indices + values below 1/32 changed, bitmap + values "
    "up to 1 - 1/(8 x bytes per element), dense above), each region encoded on its own; not included: "
    "the trainer's diff against its base, the checksums on both sides, the worker's apply"
)


@functools.lru_cache(maxsize=4096)
def region_encoding(numel: int, itemsize: int, changed_fraction: float) -> tuple[Encoding, int]:
    """The encoding the trainer would send a region of ``numel`` elements of ``itemsize`` bytes in
    when ``changed_fraction`` of them changed, and its bytes on the wire. Cached: a plan's regions
    come in few sizes, and a large fleet has hundreds of thousands of them."""
    changed = round(changed_fraction * numel)
    encoding = choose_encoding(numel, changed, itemsize)
    return encoding, encoded_size_bytes(encoding, numel, changed, itemsize)


def _region_of(t: Transfer, changed_fraction: float) -> tuple[Encoding, int]:
    numel = box_elements(t.box)
    return region_encoding(numel, t.nbytes // numel, changed_fraction)


@dataclasses.dataclass(frozen=True)
class EncodingShare:
    """The regions one encoding carries in a delta update, and their bytes."""

    regions: int
    """Tensor regions sent in this encoding (a planned class counted once per tensor it stands for)."""
    wire_bytes: int
    """Their bytes on the wire, a region sent to k workers counted k times (as ``total_bytes``)."""


@dataclasses.dataclass(frozen=True)
class DeltaPrediction:
    """One delta update of a fleet next to its FULL update, both by the same model."""

    changed_fraction: float
    delta: Prediction
    full: Prediction
    encodings: Mapping[str, EncodingShare]
    """Encoding name (``INDICES``, ``BITMAP``, ``DENSE``) -> what it carries; only those chosen."""

    @property
    def bytes_ratio(self) -> float | None:
        """The delta's bytes over the FULL update's (None: the FULL update sends nothing)."""
        return self.delta.total_bytes / self.full.total_bytes if self.full.total_bytes else None

    @property
    def seconds_ratio(self) -> float | None:
        """The delta's predicted time over the FULL update's (None: the FULL update takes no time,
        every transfer staying on its own GPU)."""
        return self.delta.seconds / self.full.seconds if self.full.seconds else None


def predict_delta(fp: FleetPlan, changed_fraction: float) -> DeltaPrediction:
    """The delta update of ``fp`` at ``changed_fraction`` (0 to 1) next to its FULL update (see the
    module docstring for what the prediction includes)."""
    fraction = checked_changed_fraction(changed_fraction, "changed_fraction")
    regions: dict[Encoding, int] = {}
    wire: dict[Encoding, int] = {}
    for t in fp.plan.transfers:
        encoding, nbytes = _region_of(t, fraction)
        count = fp.counts[t.tensor]
        regions[encoding] = regions.get(encoding, 0) + count
        wire[encoding] = wire.get(encoding, 0) + nbytes * count * len(t.destinations)
    return DeltaPrediction(
        changed_fraction=fraction,
        delta=predict(fp, lambda t: _region_of(t, fraction)[1], DELTA_MODEL_STATEMENT),
        full=predict(fp),
        encodings={e.name: EncodingShare(regions[e], wire[e]) for e in Encoding if e in regions},
    )
