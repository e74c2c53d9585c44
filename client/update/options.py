"""``PushOptions``: the keyword arguments of one push, in one object.

Each entry point of ``WeightPusher`` builds one from its arguments (``PushOptions.from_arguments``); the job builders
(``weightwire.client.update.jobs``) read the planning flags, the update session
(``weightwire.client.update.session``) the ones that go on the wire and the progress callback.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from weightwire.client.inputs.dtensor_gather import CastTo
from weightwire.client.inputs.types import ProgressFn
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.observe.trainer_metrics import TrainerMetrics

_SCOPES = {"full": pb.UPDATE_SCOPE_FULL, "partial": pb.UPDATE_SCOPE_PARTIAL}


def scope_value(scope: str) -> pb.UpdateScope.ValueType:
    """The wire value of ``"full"`` or ``"partial"``; anything else is a ``ValueError``."""
    try:
        return _SCOPES[scope]
    except KeyError:
        raise ValueError(f"scope must be 'full' or 'partial', not {scope!r}") from None


@dataclasses.dataclass(frozen=True)
class PushOptions:
    """What one push was asked to do (see ``WeightPusher.push`` for each flag's meaning)."""

    version: int
    scope: pb.UpdateScope.ValueType
    allow_unowned: bool = False
    verify_checksums: bool = False
    allow_peer_device_import: bool = False
    precheck_labels: bool = True
    only_own_device: bool = False
    progress: ProgressFn | None = None
    update_id: str = ""
    # Explicit dtype conversion on the way (e.g. fp32 master weights into a bf16 engine); never implied.
    cast_to: CastTo = None
    # Where the push's durations are recorded (``WeightPusher(metrics=...)``), and when it was asked for.
    metrics: TrainerMetrics | None = None
    started_at: float = dataclasses.field(default_factory=time.monotonic, compare=False)
    # A delta update's base version (``weightwire.client.update.delta``), or why a push asked for
    # as a delta goes whole (0: no delta was asked for).
    delta_base: int | None = None
    delta_fallback: pb.DeltaFallback.ValueType = pb.DELTA_FALLBACK_UNSPECIFIED

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> PushOptions:
        """The options an entry point of ``WeightPusher`` was called with, from ``arguments`` (its
        ``locals()`` before it does anything else): each argument named like a field, the scope's
        name made its wire value. The entry points' keywords are these fields by name, so one place
        turns any of them into options; their other arguments (the tensors, ``group``) are not
        options and are left out."""
        given = {f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments}
        given["scope"] = scope_value(given["scope"])
        return cls(**given)

    def header(self, manifest_fingerprint: str) -> pb.UpdateHeader:
        """The UpdateHeader of this push for a worker whose manifest had ``manifest_fingerprint``."""
        return pb.UpdateHeader(
            version=self.version,
            scope=self.scope,
            manifest_fingerprint=manifest_fingerprint,
            verify_checksums=self.verify_checksums,
            allow_peer_device_import=self.allow_peer_device_import,
            update_id=self.update_id or f"v{self.version}",
            delta_base=None if self.delta_base is None else pb.DeltaBase(base_version=self.delta_base),
            delta_fallback=self.delta_fallback,
        )
