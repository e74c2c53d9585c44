"""What one update accepted so far, and the rules that accept its header and one more bucket.

``WorkerService.begin_update`` begins an update only on a header that passes ``check_header``;
``weightwire.server.worker.update.Update`` then keeps one ``Accepted``: the bucket indices (none twice, a
bounded count) and the tensor names (none twice across buckets, a bounded count) its buckets
brought, whichever way each bucket loads. A bucket with tensor specs (or naming specs kept under
its ``layout_id``) is accepted by ``layout``: its layout from the worker's ``LayoutCache`` or the
checks of ``weightwire.server.rules.layout``, then its checksum fields; a bucket its importer fills
straight into the model by ``take_names``. The commit reads the count of buckets from here. Nothing is opened in here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightwire.core.delta import DELTA_BASE_MISMATCH, check_base
from weightwire.core.delta.errors import delta_error
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.text import clip_utf8
from weightwire.server.rules.layout import (
    MAX_LAYOUT_ID_BYTES,
    BucketLayout,
    LayoutCache,
    check_ownership,
    check_structure,
    duplicate_tensor,
    layout_key,
    payload_signature,
)
from weightwire.server.transports.importer import PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = [
    "MAX_BUCKETS_PER_UPDATE",
    "MAX_TENSORS_PER_UPDATE",
    "MAX_UPDATE_ID_BYTES",
    "Accepted",
    "check_header",
]

# UpdateHeader.update_id is a label for logs and status, echoed in UpdateResult.
MAX_UPDATE_ID_BYTES = 256
# What one update may accumulate (names are kept to refuse duplicates); far above any model's.
MAX_BUCKETS_PER_UPDATE = 1 << 20
MAX_TENSORS_PER_UPDATE = 1 << 20


def check_header(
    header: pb.UpdateHeader,
    *,
    weights_version: int,
    fingerprint: str,
    consistent: bool = True,
    applies_deltas: bool = False,
) -> None:
    """The rules a header passes before its update begins: a scope, a positive version newer than
    the worker's ``weights_version``, a bounded label, the manifest it was planned for; for a delta
    update (``delta_base``), an engine adapter that applies deltas and exactly the base, CONSISTENT
    (``consistent``), else DELTA_BASE_MISMATCH, so the trainer sends the update whole."""
    if header.scope not in (pb.UPDATE_SCOPE_FULL, pb.UPDATE_SCOPE_PARTIAL):
        raise WeightwireError(
            Reason.SCOPE_UNSPECIFIED,
            f"update scope is {header.scope} (unspecified or unknown); set UPDATE_SCOPE_FULL or UPDATE_SCOPE_PARTIAL",
        )
    if header.version <= 0:
        raise WeightwireError(
            Reason.INVALID_VERSION, f"version must be a positive integer, got {header.version}"
        )
    id_bytes = len(header.update_id.encode())
    if id_bytes > MAX_UPDATE_ID_BYTES:
        # It is echoed in the result and kept for GetStatus: bounded like everything stored.
        raise WeightwireError(
            Reason.MALFORMED_STREAM,
            f"update_id is {id_bytes} bytes; at most {MAX_UPDATE_ID_BYTES} (a label such as 'step-1200')",
        )
    if header.version <= weights_version:
        raise WeightwireError(
            Reason.STALE_VERSION,
            f"version {header.version} is not newer than this worker's weights version {weights_version}",
            current_version=str(weights_version),
            received_version=str(header.version),
        )
    if header.manifest_fingerprint and header.manifest_fingerprint != fingerprint:
        raise WeightwireError(
            Reason.MANIFEST_CHANGED,
            f"the update was planned for manifest {clip_utf8(header.manifest_fingerprint, 128)} but this worker's "
            f"manifest is {fingerprint} (it restarted or changed layout); fetch the manifest again",
            expected=clip_utf8(header.manifest_fingerprint, 256),
            actual=fingerprint,
        )
    if header.HasField("delta_base"):
        base = header.delta_base.base_version
        if not applies_deltas:
            raise delta_error(
                DELTA_BASE_MISMATCH,
                f"a delta against version {base} reached a worker whose engine adapter does not apply deltas; "
                "send the update whole",
                base_version=str(base),
                worker_version=str(weights_version),
                applies_deltas="false",
            )
        if base <= 0:
            # Version 0 is what a worker started with, which no update sent: no trainer holds it as
            # a base. Refusing it also makes a restarted worker (back at version 0, a new instance)
            # refuse every delta, whatever base the trainer kept.
            raise delta_error(
                DELTA_BASE_MISMATCH,
                f"a delta against version {base} names no committed update as its base; send the update whole",
                base_version=str(base),
                worker_version=str(weights_version),
            )
        check_base(base, weights_version, consistent=consistent)


def layout_unknown(index: int, why: str) -> WeightwireError:
    return WeightwireError(
        Reason.LAYOUT_UNKNOWN,
        f"bucket {index}: {why}; nothing of it was loaded: send the bucket with its tensor specs",
        bucket=str(index),
    )


class Accepted:
    """The buckets and tensor names of one update so far (``indices``, ``names``)."""

    def __init__(
        self,
        manifest: ShardManifest,
        layouts: LayoutCache,
        importers: Mapping[str, PayloadImporter],
        *,
        verify_checksums: bool,
        deltas: bool = False,
    ) -> None:
        self._manifest = manifest
        # A delta update: its specs may carry TensorDeltas, whose counts and checksums change every
        # update, so its layouts are checked every time and never cached (they would only push
        # out the layouts a trainer's whole updates reuse).
        self._deltas = deltas
        self._layouts = layouts
        self._importers = importers
        self._verify_checksums = verify_checksums
        self.indices: set[int] = set()
        self.names: set[str] = set()
        # Whether the last bucket's specs were kept under its layout_id (its ack says so).
        self.layout_kept = False

    def take_index(self, msg: pb.Bucket) -> None:
        if msg.index < 0:
            raise WeightwireError(Reason.MALFORMED_STREAM, f"bucket index {msg.index} is negative")
        if msg.index in self.indices:
            raise WeightwireError(
                Reason.DUPLICATE_BUCKET,
                f"bucket {msg.index} arrived twice in this update",
                bucket=str(msg.index),
            )
        if len(self.indices) >= MAX_BUCKETS_PER_UPDATE:
            raise WeightwireError(
                Reason.MALFORMED_STREAM, f"more than {MAX_BUCKETS_PER_UPDATE} buckets in one update"
            )
        self.indices.add(msg.index)

    def take_names(self, names: frozenset[str]) -> None:
        """The names a bucket without specs fills: none seen before, the count bounded."""
        repeated = sorted(names & self.names)
        if repeated:
            raise duplicate_tensor(repeated[0])
        if len(self.names) + len(names) > MAX_TENSORS_PER_UPDATE:
            raise WeightwireError(
                Reason.MALFORMED_STREAM, f"more than {MAX_TENSORS_PER_UPDATE} tensors in one update"
            )
        self.names |= names

    def _carries_bytes(self, payloads: Sequence[pb.Payload]) -> bool:
        for p in payloads:
            importer = self._importers.get(p.WhichOneof("handle") or "")
            if importer is not None and importer.bytes_in_message:
                return True
        return False

    def layout(self, msg: pb.Bucket, payloads: list[pb.Payload]) -> tuple[BucketLayout, int | None]:
        """Structure and ownership: bucket index, the layout (remembered, referred to by
        ``layout_id`` or checked now), names across buckets, checksum fields. Nothing is opened
        yet. Returns the layout and the checksum to verify (None: none asked for); ``layout_kept``
        then says whether the bucket's specs were kept under its ``layout_id``."""
        self.take_index(msg)
        self.layout_kept = False
        if len(msg.layout_id) > MAX_LAYOUT_ID_BYTES:
            raise WeightwireError(
                Reason.MALFORMED_STREAM,
                f"bucket {msg.index}: layout_id is {len(msg.layout_id)} bytes; at most {MAX_LAYOUT_ID_BYTES}",
                bucket=str(msg.index),
            )
        if msg.layout_id and not msg.tensors:
            layout = self._referred(msg, payloads)
        else:
            layout = self._checked(msg, payloads)
            if msg.layout_id and not self._deltas:
                self.layout_kept = self._layouts.keep_ref(
                    msg.layout_id, self._manifest.fingerprint, payload_signature(payloads), layout
                )
        repeated = layout.first_seen(self.names)
        if repeated is not None:
            raise duplicate_tensor(repeated)
        checksum = self.checksum(msg)
        if len(self.names) + len(layout.names) > MAX_TENSORS_PER_UPDATE:
            raise WeightwireError(
                Reason.MALFORMED_STREAM, f"more than {MAX_TENSORS_PER_UPDATE} tensor specs in one update"
            )
        self.names |= layout.names
        return layout, checksum

    def _referred(self, msg: pb.Bucket, payloads: Sequence[pb.Payload]) -> BucketLayout:
        """The layout this worker kept under the bucket's ``layout_id`` for its manifest, checked
        with payloads of the same sizes and handle fields as these; LAYOUT_UNKNOWN otherwise."""
        ref = msg.layout_id.hex()[:32]
        if self._deltas:
            # A delta's specs carry counts and checksums of this update: never kept, never referred to.
            raise layout_unknown(msg.index, f"a delta update refers to tensor specs by layout_id {ref}")
        kept = self._layouts.by_ref(msg.layout_id, self._manifest.fingerprint)
        if kept is None:
            raise layout_unknown(
                msg.index,
                f"this worker holds no tensor specs under layout_id {ref} for manifest "
                f"{self._manifest.fingerprint[:12]} (it restarted, changed manifest or let them go)",
            )
        signature, layout = kept
        if payload_signature(payloads) != signature:
            raise layout_unknown(
                msg.index,
                f"the payloads' sizes or kinds differ from those the specs of layout_id {ref} were accepted with",
            )
        return layout

    def _checked(self, msg: pb.Bucket, payloads: list[pb.Payload]) -> BucketLayout:
        """The layout of a bucket that carries its specs: remembered, or checked now."""
        # The count first, before any work per spec (serializing, keying or checking a bucket of
        # 2^20 specs takes seconds of CPU): the limit is known from the message's length alone.
        if len(msg.tensors) > MAX_TENSORS_PER_UPDATE - len(self.names):
            raise WeightwireError(
                Reason.MALFORMED_STREAM,
                f"bucket {msg.index} describes {len(msg.tensors)} tensors; with the {len(self.names)} before it "
                f"that is more than {MAX_TENSORS_PER_UPDATE} tensor specs in one update",
                bucket=str(msg.index),
            )
        fingerprint = self._manifest.fingerprint
        # A trainer sends byte-identical bucket messages every update (same specs, same reused
        # handles): their serialization finds the layout faster than ``layout_key`` builds its key.
        # Not with a checksum (new every update) or bytes in the message (too large to serialize again).
        layout: BucketLayout | None = None
        message = b""
        if self._deltas:
            specs = check_structure(msg, payloads, self.names, deltas=True)
            self.checksum(msg)  # its fields before ownership, as for a layout checked the first time
            layout = BucketLayout.of(specs, check_ownership(specs, self._manifest))
        elif not msg.HasField("checksum") and not self._carries_bytes(payloads):
            message = msg.SerializeToString()
            layout = self._layouts.get_message(message, fingerprint)
        if layout is None:
            key = (layout_key(msg, payloads), fingerprint)
            layout = self._layouts.get(key)
            if layout is None:
                specs = check_structure(msg, payloads, self.names)
                # The checksum's own checks come next in the rule order; they depend on the header,
                # so they run per update too, but a bad checksum field must still win over ownership.
                self.checksum(msg)
                layout = BucketLayout.of(specs, check_ownership(specs, self._manifest))
                self._layouts.put(key, layout)
            if message:
                self._layouts.put_message(message, fingerprint, key)
        return layout

    def checksum(self, msg: pb.Bucket) -> int | None:
        """The CRC-32 to verify for ``msg`` (None: none asked for), its fields checked."""
        if not self._verify_checksums or not msg.HasField("checksum"):
            return None
        if msg.checksum.algorithm != pb.CHECKSUM_ALGORITHM_CRC32:
            raise WeightwireError(
                Reason.INVALID_CHECKSUM,
                f"bucket {msg.index}: checksum algorithm {msg.checksum.algorithm} is unspecified or unknown; use CHECKSUM_ALGORITHM_CRC32",
            )
        if not 0 <= msg.checksum.value < 2**32:
            raise WeightwireError(
                Reason.INVALID_CHECKSUM,
                f"bucket {msg.index}: CRC-32 value {msg.checksum.value} is out of range",
            )
        return msg.checksum.value
