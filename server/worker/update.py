"""One update in progress on a worker: the bucket rules in the order they apply, commit and failure.

``WorkerService.begin_update`` (server/worker/service.py) creates an ``Update`` once it accepted a header;
the service's stream loop then hands it each bucket and the commit. An update sees its worker only
through ``UpdateContext`` (what it reads: adapter, manifest, devices, importers, layout cache) and
``UpdateOwner`` (the two calls that end it: committed, failed), so the service's own state is
written by the service alone.

Per bucket (``Update.bucket``) the importer of its payloads says how it loads. One that fills the
model itself (``FillsModel``: a transfer group's slices) gets it whole (``filled_bucket``). Every
other bucket is accepted (``accepted.Accepted``: index, layout from the cache or the checks of
``server/rules/layout.py``, names across buckets, checksum fields, ownership), its payloads are
checked and the worker's own one is selected with its importer (``payload_checks``), opened,
verified and loaded by views, and acked. The commit is the update's gate: every bucket counted, a FULL update
complete, the engine's own finish, then the version.

In a delta update (``UpdateHeader.delta_base``, checked at the header) a spec may carry a
TensorDelta: only its encoded bytes are read, checked whole before its batch writes anything,
applied by the adapter (``AppliesDeltas``) and verified against the trainer's result checksums
(docs/deltas.md, "The worker").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Protocol, cast

from weightwire.core.capabilities import has_capability
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.text import MAX_MESSAGE_BYTES, bounded_join, clip_utf8, name_list
from weightwire.server.observe.update_events import UpdateTally
from weightwire.server.rules.layout import BucketLayout
from weightwire.server.rules.selection import Selection
from weightwire.server.rules.views import batch_load, batch_views
from weightwire.server.transports.importer import (
    FillsModel,
    ImportContext,
    ImportedPayload,
    KeptByName,
    PayloadImporter,
    ReceivesBytes,
    transport_name,
)
from weightwire.server.worker.accepted import MAX_BUCKETS_PER_UPDATE, MAX_TENSORS_PER_UPDATE, Accepted
from weightwire.server.worker.adapter import TracksWrites
from weightwire.server.worker.delta_load import DeltaLoads
from weightwire.server.worker.delta_regions import refuse_region_deltas
from weightwire.server.worker.filled_bucket import fill_bucket, land_update
from weightwire.server.worker.payload_checks import (
    check_delta_payloads,
    check_payloads,
    refuse_unfilled,
    select_payload,
)
from weightwire.server.worker.update_context import UpdateContext, cancelled_error, now_timestamp
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = [
    "MAX_BUCKETS_PER_UPDATE",
    "MAX_TENSORS_PER_UPDATE",
    "Update",
    "UpdateContext",
    "UpdateOwner",
    "cancelled_error",
    "now_timestamp",
]

log = logging.getLogger(__name__)


class UpdateOwner(Protocol):
    """The worker an update reports its end to, exactly once (from the update's own thread)."""

    def update_committed(self, update: Update, result: pb.UpdateResult) -> None:
        """The update committed: advance the version, then let the update go."""
        ...

    def update_failed(self, update: Update, err: WeightwireError, new_state: pb.WorkerState) -> None:
        """The update failed with ``err``; the worker's state becomes ``new_state``."""
        ...


@dataclasses.dataclass
class _Loaded:
    """What importing one bucket's payload took and did."""

    opened: bool
    open_ns: int
    load_ns: int
    # Bytes that arrived over the network for it (a transfer group's mapping says; else 0).
    received: int = 0
    # The trainer's name this worker keeps the payload's handle under (a CUDA IPC storage set).
    kept_as: bytes = b""


class Update:
    """One update in progress. Created by ``WorkerService.begin_update``; finished by commit or fail."""

    def __init__(
        self,
        ctx: UpdateContext,
        owner: UpdateOwner,
        header: pb.UpdateHeader,
        *,
        prior_state: pb.WorkerState,
        previous_version: int,
        rpc_ended: threading.Event | None = None,
    ) -> None:
        self._ctx = ctx
        self._owner = owner
        self.header = header
        self.prior_state = prior_state
        self.previous_version = previous_version
        self._rpc_ended = rpc_ended
        self._t0 = time.perf_counter_ns()
        self.is_delta = header.HasField("delta_base")
        self._accepted = Accepted(
            ctx.manifest,
            ctx.layouts,
            ctx.importers,
            verify_checksums=header.verify_checksums,
            deltas=self.is_delta,
        )
        # What the deltas applied: tensors, their changed elements, result checksums verified.
        self._deltas = DeltaLoads()
        # The layouts whose owned tensors were loaded, and how many those are (no name twice: the
        # duplicate rule holds across buckets), so a commit checks a count, not 399 names.
        self._loaded_layouts: list[BucketLayout] = []
        # Tensors filled by buckets their importer loads itself, which have no layout.
        self._filled_names: set[str] = set()
        # What writes the filled buckets' held-back bytes into the model, run at the commit.
        self._landings: list[tuple[int, list[Callable[[], None]]]] = []
        # What the acked buckets loaded: the result's counts, the commit's check, a failure's outcome.
        self.tally = UpdateTally()
        self._loaded_any = False
        self._mappings: dict[Hashable, ImportedPayload] = {}
        # How it ends: begun (the engine was told it started), finished (failed or committed), and
        # whether the engine was told it ended (end_update(True)): a later failure must not tell it again.
        self.begun = False
        self.finished = False
        self._finish_lock = threading.Lock()
        self._engine_ended = False

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def call_ended(self) -> bool:
        """The call carrying this update is over (cancelled, or its deadline passed): nobody is
        waiting for its result, so it must not go on, and above all not commit."""
        return self._rpc_ended is not None and self._rpc_ended.is_set()

    @property
    def abandoned(self) -> bool:
        """It is ending but still holds the worker: failed or committed and not yet let go, or its
        stream is over (the client cancelled or timed out) and its thread is still unwinding
        (typically inside the engine's load). A new update waits for such a one."""
        return self.finished or self.call_ended

    def open_mapping_count(self) -> int:
        return len(self._mappings)

    # --- failure -------------------------------------------------------------------------------

    def fail(self, err: WeightwireError) -> WeightwireError:
        """End the update with ``err`` (idempotent). Returns ``err`` so callers can ``raise`` it."""
        with self._finish_lock:
            if self.finished:
                return err
            self.finished = True
        self._close_mappings()
        if self.begun and not self._engine_ended:
            try:
                self._ctx.adapter.end_update(False)
            except Exception:
                log.exception("engine adapter failed in end_update(False)")
        wrote = self._loaded_any and self._engine_wrote()
        new_state = pb.WORKER_STATE_INCONSISTENT if wrote else self.prior_state
        shown = clip_utf8(str(err), MAX_MESSAGE_BYTES)  # it may quote what the client sent
        if wrote:
            log.error(
                "update %d failed after loading tensors; worker is INCONSISTENT: %s", self.version, shown
            )
        else:
            log.warning("update %d failed: %s", self.version, shown)
        self._owner.update_failed(self, err, new_state)
        return err

    def _engine_wrote(self) -> bool:
        """Whether the engine changed the model in this update. An adapter that holds tensors back
        until it can apply them (vLLM reloads a fused layer only whole) says so with
        ``touched_model()`` (``TracksWrites``); without it, every load counts as a write."""
        adapter = self._ctx.adapter
        return (
            bool(cast(TracksWrites, adapter).touched_model())
            if has_capability(adapter, TracksWrites)
            else True
        )

    def _close_mappings(self) -> None:
        mappings, self._mappings = self._mappings, {}
        for mapping in mappings.values():
            try:
                mapping.close()
            except Exception:
                log.exception("closing a payload mapping failed")

    # --- buckets -------------------------------------------------------------------------------

    def bucket(self, msg: pb.Bucket) -> pb.BucketAck:
        """Apply the bucket rules, load owned tensors, return the ack (after the device copy)."""
        if self.finished:
            raise WeightwireError(Reason.MALFORMED_STREAM, "a bucket arrived after the update ended")
        if self.call_ended:
            # A PushUpdate call holds every bucket already: without this it would load them all
            # (and commit) after its client gave up.
            raise self.fail(cancelled_error())
        try:
            ack = self._bucket(msg)
        except WeightwireError as err:
            raise self.fail(err) from None
        self.tally.add(ack)
        return ack

    def _bucket(self, msg: pb.Bucket) -> pb.BucketAck:
        filler = self._filler(msg)
        if filler is not None:
            return self._filled_bucket(msg, filler)
        payloads = list(msg.payloads)
        if payloads and not msg.tensors and not msg.layout_id:
            refuse_unfilled(self._ctx, payloads, allow_peer=self.header.allow_peer_device_import)
        layout, checksum = self._accepted.layout(msg, payloads)
        if self.is_delta and any(s.delta is not None for s in layout.specs):
            check_delta_payloads(self._ctx, msg.index, payloads)
        ack = pb.BucketAck(
            index=msg.index,
            tensors_skipped=len(layout.specs) - len(layout.owned),
            layout_kept=self._accepted.layout_kept,
        )
        # Every payload's label and handle are checked, also those this worker does not select and
        # in a bucket it owns nothing of: a malformed bucket is malformed for everyone.
        check_payloads(self._ctx, payloads)
        if not layout.owned:
            return ack
        sel, importer = select_payload(self._ctx, payloads, allow_peer=self.header.allow_peer_device_import)
        loaded = self._import(msg.index, layout, sel, importer, checksum)
        self._loaded_layouts.append(layout)
        ack.tensors_loaded = len(layout.owned)
        ack.bytes_loaded = layout.owned_bytes
        ack.source_device.CopyFrom(sel.device.to_proto())
        ack.transport = importer.transport
        ack.peer_device_import = sel.peer
        ack.handle_opened = loaded.opened
        ack.open_duration_ns = loaded.open_ns
        ack.load_duration_ns = loaded.load_ns
        ack.bytes_received = loaded.received
        ack.storage_set_kept = loaded.kept_as
        return ack

    def _filler(self, msg: pb.Bucket) -> FillsModel | None:
        """The importer that loads this bucket itself, if one of its payloads' importers says so."""
        for payload in msg.payloads:
            importer = self._ctx.importers.get(payload.WhichOneof("handle") or "")
            if has_capability(importer, FillsModel) and cast(FillsModel, importer).fills_model(payload):
                return cast(FillsModel, importer)
        return None

    def _filled_bucket(self, msg: pb.Bucket, filler: FillsModel) -> pb.BucketAck:
        self._accepted.take_index(msg)
        if not self.is_delta:
            for payload in msg.payloads:
                refuse_region_deltas(msg.index, payload)
        ctx = self._ctx

        def will_write() -> None:
            self._loaded_any = True

        ack, names, landings = fill_bucket(
            msg,
            filler,
            adapter=ctx.adapter,
            manifest=ctx.manifest,
            own_device=ctx.own_device,
            accept_names=self._accepted.take_names,
            will_write=will_write,
            call_ended=self._rpc_ended,
            ordinal=len(self._landings),
        )
        self._filled_names |= names
        self._landings.append((msg.index, landings))
        if self.is_delta:
            # Its regions' deltas are applied and verified at the commit, which fails otherwise.
            self._deltas.count_regions(msg.payloads)
        return ack

    def _import(
        self,
        index: int,
        layout: BucketLayout,
        sel: Selection,
        importer: PayloadImporter,
        checksum: int | None,
    ) -> _Loaded:
        """Open the payload (once per handle per update), check its real size, verify, load."""
        t_open = time.perf_counter_ns()
        mapping, opened = self._open(importer, sel, layout)
        open_ns = time.perf_counter_ns() - t_open
        try:
            if mapping.size_bytes < sel.payload.size_bytes:
                raise WeightwireError(
                    Reason.INVALID_SIZE,
                    f"payload says size_bytes {sel.payload.size_bytes} but its storage holds only {mapping.size_bytes} bytes",
                )
            if checksum is not None:
                actual = mapping.crc32(sel.payload.size_bytes)
                if actual != checksum:
                    raise WeightwireError(
                        Reason.CHECKSUM_MISMATCH,
                        f"bucket {index}: CRC-32 of the payload is {actual:#010x}, the sender said {checksum:#010x}",
                        bucket=str(index),
                    )
            t_load = time.perf_counter_ns()
            self._load(index, layout, mapping)
            load_ns = time.perf_counter_ns() - t_load
        finally:
            if mapping not in self._mappings.values():
                # Not shared within this update: done with it (a reusable importer keeps its cache).
                mapping.close()
        return _Loaded(
            opened=opened,
            open_ns=open_ns,
            load_ns=load_ns,
            received=cast(ReceivesBytes, mapping).bytes_received
            if has_capability(mapping, ReceivesBytes)
            else 0,
            kept_as=cast(KeptByName, mapping).kept_as if has_capability(mapping, KeptByName) else b"",
        )

    def _will_write(self) -> None:
        self._loaded_any = True

    def _load(self, index: int, layout: BucketLayout, mapping: ImportedPayload) -> None:
        if layout.owned_deltas:
            self._deltas.load(index, layout, mapping, self._ctx.adapter, will_write=self._will_write)
            return
        for batch in layout.read_plan(mapping.copy_chunk_bytes):
            views = batch_views(mapping, batch)
            self._loaded_any = True
            try:
                batch_load(mapping, batch, views, self._ctx.adapter)()
            except WeightwireError:
                raise
            except Exception as e:
                raise WeightwireError(
                    Reason.LOAD_FAILED, f"the engine failed to load bucket {index}: {e!r}", bucket=str(index)
                ) from e
            finally:
                del views

    def _open(
        self, importer: PayloadImporter, sel: Selection, layout: BucketLayout
    ) -> tuple[ImportedPayload, bool]:
        ctx = ImportContext(
            own_device=self._ctx.own_device,
            source=sel.device,
            peer=sel.peer,
            target=self._ctx.target_device,
            owned=layout.owned,
            call_ended=self._rpc_ended,
        )
        key = None if importer.reusable else importer.cache_key(sel.payload)
        if key is not None and key in self._mappings:
            return self._mappings[key], False
        try:
            mapping, opened = importer.open(sel.payload, ctx)
        except WeightwireError:
            raise
        except Exception as e:
            raise WeightwireError(
                Reason.HANDLE_OPEN_FAILED,
                f"opening the {transport_name(importer.field_name)} payload failed: {e!r}",
            ) from e
        if key is not None:
            self._mappings[key] = mapping
        return mapping, opened

    # --- commit --------------------------------------------------------------------------------

    def commit(self, msg: pb.UpdateCommit) -> pb.UpdateResult:
        """Verify the update is complete, then advance the version. Raises on any gap."""
        if self.finished:
            raise WeightwireError(Reason.MALFORMED_STREAM, "a commit arrived after the update ended")
        try:
            return self._commit(msg)
        except WeightwireError as err:
            raise self.fail(err) from None

    def _land_filled(self) -> None:
        """Write the filled buckets' bytes held back until the commit (``fill_bucket``)."""
        landings, self._landings = self._landings, []
        land_update(landings)  # each step that writes announces it (will_write) first

    def _commit(self, msg: pb.UpdateCommit) -> pb.UpdateResult:
        received = len(self._accepted.indices)
        if msg.bucket_count != received:
            raise WeightwireError(
                Reason.BUCKET_COUNT_MISMATCH,
                f"commit says {msg.bucket_count} buckets were sent but this worker received {received}",
                expected=str(msg.bucket_count),
                received=str(received),
            )
        manifest = self._ctx.manifest
        if self.header.scope == pb.UPDATE_SCOPE_FULL and self.tally.tensors_loaded < len(manifest.tensors):
            loaded = {
                name for layout in self._loaded_layouts for name in layout.owned_names
            } | self._filled_names
            missing = sorted(set(manifest.tensors) - loaded)
            if missing:
                raise WeightwireError(
                    Reason.INCOMPLETE_UPDATE,
                    f"a FULL update must deliver every tensor this worker owns; {len(missing)} of "
                    f"{len(manifest.tensors)} missing: {name_list(missing)}",
                    missing=bounded_join(missing),
                    missing_count=str(len(missing)),
                )
        if self.call_ended:
            # The client gave up (its deadline passed while the last loads ran, or it cancelled):
            # it was told the update failed, so it must not be applied.
            raise cancelled_error()
        self._land_filled()
        self._close_mappings()
        try:
            self._engine_ended = True
            self._ctx.adapter.end_update(True)
        except WeightwireError:
            # The engine's own typed refusal of the commit (vLLM: a fused layer left incomplete),
            # as it is; whether the model changed is the adapter's touched_model() to say.
            self._loaded_any = True
            raise
        except Exception as e:
            self._loaded_any = True  # the engine may have half-finished post-processing
            raise WeightwireError(
                Reason.LOAD_FAILED, f"the engine failed to finish update {self.version}: {e!r}"
            ) from e
        if self.call_ended:
            # The deadline passed inside the engine's own finishing step: the new weights are in the
            # model, but the client was told the update failed, so the version stays and the worker
            # says it mixes versions until a FULL update lands.
            self._loaded_any = True
            raise cancelled_error()
        with self._finish_lock:
            self.finished = True
        if self.header.scope == pb.UPDATE_SCOPE_FULL or self.prior_state == pb.WORKER_STATE_CONSISTENT:
            new_state = pb.WORKER_STATE_CONSISTENT
        else:
            new_state = pb.WORKER_STATE_INCONSISTENT
        result = pb.UpdateResult(
            version=self.version,
            previous_version=self.previous_version,
            scope=self.header.scope,
            bucket_count=len(self._accepted.indices),
            tensors_loaded=self.tally.tensors_loaded,
            bytes_loaded=self.tally.bytes_loaded,
            handles_opened=self.tally.handles_opened,
            bytes_received=self.tally.bytes_received,
            duration_ns=time.perf_counter_ns() - self._t0,
            state=new_state,
            update_id=self.header.update_id,
            finish_time=now_timestamp(),
        )
        self._deltas.fill_result(result, self.header)
        self._owner.update_committed(self, result)
        return result
