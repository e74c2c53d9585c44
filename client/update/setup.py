"""What every entry point of ``WeightPusher`` sets up before it plans: the workers an update goes
to, the GetStatus re-check already on its way, and the exporter; and the one rule of when an
update re-checks its workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import grpc
from weightwire.client.transports import exporter as exp
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb


@dataclasses.dataclass
class PushSetup:
    """What every entry point first needs: the workers the update goes to, and the GetStatus
    re-check already on its way (answers looked at only after planning, in ``_run``)."""

    manifests: dict[str, ShardManifest]
    recheck: dict[str, grpc.Future] | None
    # Set when the caller already re-checked the fingerprints (a multi-rank push does it before
    # the ranks agree, so that a restarted worker fails every rank before anything is sent).
    rechecked: bool = False
    # The exporter the update's bytes go through (None: buckets that carry their own payloads).
    exporter: exp.Exporter | None = None


def recheck_needed(manifests: Mapping[str, ShardManifest], exporter: exp.Exporter | None) -> bool:
    """Whether an update re-checks its workers before sending: with several workers (so that a
    restarted one fails the push before any other loads a byte) or over a transfer group. One
    worker's own header check (its fingerprint covers the instance id) refuses a restart before it
    loads anything, and there is no other worker that could have loaded a byte."""
    return len(manifests) > 1 or (exporter is not None and exporter.routes_each_update)


def updating_workers(statuses: Mapping[str, pb.GetStatusResponse] | None) -> set[str]:
    """The workers the re-check found running an update (someone else's: this pusher runs one at a time)."""
    return {a for a, st in (statuses or {}).items() if st.state == pb.WORKER_STATE_UPDATING}
