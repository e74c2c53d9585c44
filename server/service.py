"""The worker service core: update state machine, per-bucket rules, status. No gRPC in here.

``WorkerService`` is what an engine worker runs; the gRPC servicer (``weightwire.server.servicer``)
only converts messages and maps ``WeightwireError`` to a status. The rules, in the order they are
applied to each bucket, live in ``Update.bucket``; payload choice in ``selection.select_own_payload``;
spec checks in ``validation``; handle import in ``transports``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch
from google.protobuf import timestamp_pb2
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.server.adapter import EngineAdapter
from weightwire.server.selection import Selection, payload_labels, select_own_payload
from weightwire.server.transports import (
    ImportContext,
    ImportedPayload,
    PayloadImporter,
    ViewItem,
    make_importers,
    strided_views,
    transport_name,
)
from weightwire.server.validation import (
    CheckedSpec,
    check_against_manifest,
    check_in_bounds,
    check_payload_size,
    check_spec,
)
from weightwire.v1 import weight_transfer_pb2 as pb

log = logging.getLogger(__name__)

# How many names an error message lists before "... and N more" (metadata carries more).
_MAX_NAMES_IN_MESSAGE = 10
# Metadata values travel in a gRPC trailer, whose size is limited (8 KiB by default).
_MAX_METADATA_CHARS = 3000
_HANDLE_KIND = {"host_shm": pb.DEVICE_KIND_HOST, "cuda_ipc": pb.DEVICE_KIND_CUDA}

CommitHook = Callable[[pb.UpdateResult], None]
# Validated bucket layouts a worker remembers (a trainer sends the same buckets every update; a
# packed push of a large model has a few hundred distinct ones). Oldest first out beyond this.
_MAX_CACHED_LAYOUTS = 1024


# ...and at most this many tensor specs over all of them (a bound on the cache's memory).
_MAX_CACHED_SPECS = 1 << 16


def _layout_key(msg: pb.Bucket, payloads: list[pb.Payload]) -> bytes:
    """What the update-independent checks of a bucket depend on, as bytes: its serialized tensor
    specs and each payload's size and handle field (not the handle itself, the index or the
    checksum, which change between updates and are checked per update)."""
    specs_only = pb.Bucket()
    specs_only.tensors.MergeFrom(msg.tensors)
    sizes = ";".join(f"{p.size_bytes}:{p.WhichOneof('handle') or ''}" for p in payloads)
    return specs_only.SerializeToString() + b"|" + sizes.encode()


@dataclasses.dataclass(frozen=True)
class _BucketLayout:
    """What the update-independent checks of one bucket message concluded.

    Keyed by the exact serialized specs, each payload's size and handle field (``_layout_key``) and
    the manifest fingerprint, so a hit means the very same specs and payload sizes were already
    checked against this manifest: every
    spec valid and in bounds of every payload, no name twice in the bucket, every payload with a
    handle, owned tensors matching the manifest. Only successes are stored. The per-update rules
    (bucket index, names across buckets, checksum, selection, open) still run on every bucket.
    """

    specs: tuple[CheckedSpec, ...]
    names: frozenset[str]
    owned: tuple[CheckedSpec, ...]
    owned_names: tuple[str, ...]
    views: tuple[ViewItem, ...]
    owned_bytes: int


def _now() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


def name_list(names: Iterable[str], limit: int = _MAX_NAMES_IN_MESSAGE) -> str:
    """``a, b, c ... and 12 more`` for messages."""
    items = list(names)
    text = ", ".join(items[:limit])
    return text + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def bounded_join(names: Iterable[str], max_chars: int = _MAX_METADATA_CHARS) -> str:
    """Comma-joined names cut at a name boundary to fit a trailer; ends with ``,...`` when cut."""
    out: list[str] = []
    used = 0
    for name in names:
        if used + len(name) + 1 > max_chars:
            out.append("...")
            break
        out.append(name)
        used += len(name) + 1
    return ",".join(out)


def _cancelled() -> WeightwireError:
    # No ErrorInfo reason: gRPC itself reports CANCELLED to the (gone) client; this is for GetStatus.
    return WeightwireError("", "the client went away (stream cancelled) before commit", code="CANCELLED")


class WorkerService:
    """One engine worker: its adapter, its identity, its weights version and state."""

    def __init__(
        self,
        adapter: EngineAdapter,
        *,
        own_device: DeviceRef,
        host_device: DeviceRef | None = None,
        target_device: torch.device | None = None,
        importers: dict[str, PayloadImporter] | None = None,
        on_commit: CommitHook | None = None,
        is_local_cuda: Callable[[DeviceRef], bool] | None = None,
    ) -> None:
        self.adapter = adapter
        self.own_device = own_device
        self.host_device = host_device if host_device is not None else DeviceRef.host()
        self.target_device = target_device if target_device is not None else torch.device(
            "cuda" if own_device.is_cuda else "cpu"
        )
        self.importers = importers if importers is not None else make_importers()
        self.on_commit = on_commit
        self._is_local_cuda = is_local_cuda
        self._manifest: ShardManifest = adapter.manifest()
        self._mu = threading.Lock()
        self._version = 0
        self._state: int = pb.WORKER_STATE_CONSISTENT
        self._active: Update | None = None
        self._last_result: pb.UpdateResult | None = None
        self._last_error: pb.ErrorDetail | None = None
        self._succeeded = 0
        self._failed = 0
        self._listeners: list[Callable[[bool], None]] = []
        self._layouts: dict[tuple[bytes, str], _BucketLayout] = {}
        self._layout_specs = 0

    # --- identity and status -------------------------------------------------------------------

    @property
    def manifest(self) -> ShardManifest:
        return self._manifest

    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def state(self) -> int:
        return self._state

    @property
    def serving(self) -> bool:
        """False while the model mixes versions (INCONSISTENT): health says NOT_SERVING."""
        return self._state != pb.WORKER_STATE_INCONSISTENT

    def add_state_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(serving)`` is called after every state change (the health service uses it)."""
        self._listeners.append(listener)
        listener(self.serving)

    def _notify(self) -> None:
        serving = self.serving
        for listener in self._listeners:
            listener(serving)

    def open_mappings(self) -> int:
        active = self._active
        held = sum(imp.held_mappings() for imp in self.importers.values())
        return held + (active.open_mapping_count() if active is not None else 0)

    def get_manifest(self) -> pb.GetManifestResponse:
        return pb.GetManifestResponse(manifest=self._manifest.to_proto())

    def get_status(self) -> pb.GetStatusResponse:
        with self._mu:
            resp = pb.GetStatusResponse(
                weights_version=self._version,
                state=self._state,  # type: ignore[arg-type]
                device=self._manifest.device.to_proto(),
                rank=self._manifest.rank.to_proto(),
                manifest_fingerprint=self._manifest.fingerprint,
                worker_id=self._manifest.worker_id,
                updates_succeeded=self._succeeded,
                updates_failed=self._failed,
                instance_id=self._manifest.instance_id,
            )
            if self._last_result is not None:
                resp.last_result.CopyFrom(self._last_result)
            if self._last_error is not None:
                resp.last_error.CopyFrom(self._last_error)
        resp.open_mappings = self.open_mappings()
        return resp

    def close(self) -> None:
        """Release every mapping (worker shutdown). An update still running is failed first."""
        active = self._active
        if active is not None:
            active.fail(WeightwireError("", "the worker is shutting down", code="CANCELLED"))
        for imp in self.importers.values():
            imp.release()

    # --- updates -------------------------------------------------------------------------------

    def cached_layout(self, key: tuple[bytes, str]) -> _BucketLayout | None:
        return self._layouts.get(key)

    def remember_layout(self, key: tuple[bytes, str], layout: _BucketLayout) -> None:
        # Updates run one at a time, so only one thread ever adds; drop the oldest entries.
        while self._layouts and (
            len(self._layouts) >= _MAX_CACHED_LAYOUTS or self._layout_specs + len(layout.specs) > _MAX_CACHED_SPECS
        ):
            self._layout_specs -= len(self._layouts.pop(next(iter(self._layouts))).specs)
        if len(layout.specs) <= _MAX_CACHED_SPECS:
            self._layouts[key] = layout
            self._layout_specs += len(layout.specs)

    def _record_failure(self, err: WeightwireError, version: int) -> None:
        detail = pb.ErrorDetail(code=err.code, reason=err.reason, message=err.message, time=_now(), version=version)
        self._last_error = detail
        self._failed += 1

    def begin_update(self, header: pb.UpdateHeader) -> Update:
        """Accept a header (or raise): one update at a time, version newer, manifest unchanged."""
        with self._mu:
            try:
                if self._active is not None:
                    raise WeightwireError(
                        Reason.UPDATE_IN_PROGRESS,
                        f"another update (version {self._active.version}) is running on this worker; "
                        "retry after it finished",
                        active_version=str(self._active.version),
                    )
                self._check_header(header)
            except WeightwireError as err:
                self._record_failure(err, header.version)
                raise
            update = Update(self, header, prior_state=self._state)
            self._active = update
            self._state = pb.WORKER_STATE_UPDATING
        self._notify()
        try:
            self.adapter.begin_update(header.version)
        except Exception as e:
            # An adapter's own WeightwireError already names its reason (e.g. ENGINE_NOT_PAUSED).
            refused = e if isinstance(e, WeightwireError) else WeightwireError(
                Reason.LOAD_FAILED, f"the engine refused to begin update {header.version}: {e!r}"
            )
            update.fail(refused)
            raise refused from e
        update.begun = True
        return update

    def _check_header(self, header: pb.UpdateHeader) -> None:
        if header.scope not in (pb.UPDATE_SCOPE_FULL, pb.UPDATE_SCOPE_PARTIAL):
            raise WeightwireError(
                Reason.SCOPE_UNSPECIFIED, f"update scope is {header.scope} (unspecified or unknown); set UPDATE_SCOPE_FULL or UPDATE_SCOPE_PARTIAL"
            )
        if header.version <= 0:
            raise WeightwireError(Reason.INVALID_VERSION, f"version must be a positive integer, got {header.version}")
        if header.version <= self._version:
            raise WeightwireError(
                Reason.STALE_VERSION,
                f"version {header.version} is not newer than this worker's weights version {self._version}",
                current_version=str(self._version),
                received_version=str(header.version),
            )
        fingerprint = self._manifest.fingerprint
        if header.manifest_fingerprint and header.manifest_fingerprint != fingerprint:
            raise WeightwireError(
                Reason.MANIFEST_CHANGED,
                f"the update was planned for manifest {header.manifest_fingerprint} but this worker's manifest is "
                f"{fingerprint} (it restarted or changed layout); fetch the manifest again",
                expected=header.manifest_fingerprint,
                actual=fingerprint,
            )

    def _finish(self, update: Update, *, new_state: int, result: pb.UpdateResult | None, err: WeightwireError | None) -> None:
        with self._mu:
            self._state = new_state
            if result is not None:
                self._version = result.version
                self._last_result = result
                self._succeeded += 1
            if err is not None:
                self._record_failure(err, update.version)
        if err is not None:
            # Mappings cached for reuse (CUDA IPC) pin the sender's memory. After a failed or
            # cancelled update the sender may be gone for good, so let them go; a live trainer's next
            # update simply reopens its handles (about a millisecond each).
            for importer in self.importers.values():
                if importer.reusable:
                    importer.release()
        self._notify()

    def _release(self, update: Update) -> None:
        with self._mu:
            if self._active is update:
                self._active = None

    def push(
        self, requests: Iterator[pb.PushWeightsRequest], *, client_gone: Callable[[], bool] | None = None
    ) -> Iterator[pb.PushWeightsResponse]:
        """The PushWeights stream: header, buckets, commit. Raises WeightwireError on any failure.

        If the caller stops iterating (client gone) or ``requests`` raises, the update fails and,
        when something was already loaded, the worker becomes INCONSISTENT. ``client_gone`` tells a
        cancelled stream (recorded as CANCELLED) from one the client closed without a commit.
        """
        update: Update | None = None
        try:
            first = next(requests, None)
            if first is None or first.WhichOneof("message") != "header":
                what = "nothing" if first is None else (first.WhichOneof("message") or "an empty message")
                err = WeightwireError(Reason.MALFORMED_STREAM, f"an update must start with a header; received {what}")
                with self._mu:
                    self._record_failure(err, 0)
                raise err
            update = self.begin_update(first.header)
            for req in requests:
                kind = req.WhichOneof("message")
                if kind == "bucket":
                    yield pb.PushWeightsResponse(ack=update.bucket(req.bucket))
                elif kind == "commit":
                    yield pb.PushWeightsResponse(result=update.commit(req.commit))
                    return
                else:
                    what = "a second header" if kind == "header" else "an empty message"
                    raise update.fail(WeightwireError(Reason.MALFORMED_STREAM, f"received {what} inside an update"))
            if client_gone is not None and client_gone():
                raise update.fail(_cancelled())
            raise update.fail(
                WeightwireError(Reason.MALFORMED_STREAM, "the stream ended before a commit; the update was not applied")
            )
        except WeightwireError:
            raise
        except Exception as e:
            # The request stream broke (client gone) or a bug: never leave the update half-open.
            if update is not None and not update.finished:
                gone = client_gone is not None and client_gone()
                err = _cancelled() if gone else WeightwireError("", f"internal error in the worker: {e!r}", code="INTERNAL")
                update.fail(err)
            raise
        finally:
            if update is not None and not update.finished:
                update.fail(_cancelled())


class Update:
    """One update in progress. Created by ``WorkerService.begin_update``; finished by commit or fail."""

    def __init__(self, service: WorkerService, header: pb.UpdateHeader, *, prior_state: int) -> None:
        self.service = service
        self.header = header
        self.version = header.version
        self.prior_state = prior_state
        self.begun = False
        self.finished = False
        self._manifest = service.manifest
        self._t0 = time.perf_counter_ns()
        self._bucket_indices: set[int] = set()
        self._names_seen: set[str] = set()
        self._loaded: set[str] = set()
        self._loaded_any = False
        self._bytes_loaded = 0
        self._handles_opened = 0
        self._mappings: dict[Hashable, ImportedPayload] = {}
        self._finish_lock = threading.Lock()

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
        if self.begun:
            try:
                self.service.adapter.end_update(False)
            except Exception:
                log.exception("engine adapter failed in end_update(False)")
        new_state = pb.WORKER_STATE_INCONSISTENT if self._loaded_any else self.prior_state
        if self._loaded_any:
            log.error("update %d failed after loading tensors; worker is INCONSISTENT: %s", self.version, err)
        else:
            log.warning("update %d failed: %s", self.version, err)
        self.service._finish(self, new_state=new_state, result=None, err=err)
        self.service._release(self)
        return err

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
        try:
            return self._bucket(msg)
        except WeightwireError as err:
            raise self.fail(err) from None

    def _bucket(self, msg: pb.Bucket) -> pb.BucketAck:
        # 1. Structure: bucket index, tensor specs, payload labels and sizes. Nothing is opened yet.
        if msg.index < 0:
            raise WeightwireError(Reason.MALFORMED_STREAM, f"bucket index {msg.index} is negative")
        if msg.index in self._bucket_indices:
            raise WeightwireError(Reason.DUPLICATE_BUCKET, f"bucket {msg.index} arrived twice in this update", bucket=str(msg.index))
        self._bucket_indices.add(msg.index)
        payloads = list(msg.payloads)
        key = (_layout_key(msg, payloads), self._manifest.fingerprint)
        layout = self.service.cached_layout(key)
        if layout is None:
            layout = self._check_layout(msg, payloads)
            self.service.remember_layout(key, layout)
        if not layout.names.isdisjoint(self._names_seen):
            # The first spec (in order) already seen in an earlier bucket, as the full check names it.
            name = next(s.name for s in layout.specs if s.name in self._names_seen)
            raise WeightwireError(Reason.DUPLICATE_TENSOR, f"tensor {name!r} arrived twice in this update", tensor=name)
        checksum = self._checked_checksum(msg)
        owned = layout.owned
        self._names_seen |= layout.names
        ack = pb.BucketAck(index=msg.index, tensors_skipped=len(layout.specs) - len(owned))
        if not owned:
            # Labels are still checked (a malformed bucket is malformed for everyone).
            payload_labels(payloads)
            return ack
        # 3. Selection: the payload of this worker's own device.
        sel = select_own_payload(
            payloads,
            self.service.own_device,
            allow_peer=self.header.allow_peer_device_import,
            host_device=self.service.host_device,
            **({"is_local_cuda": self.service._is_local_cuda} if self.service._is_local_cuda else {}),
        )
        field = sel.payload.WhichOneof("handle") or ""
        importer = self.service.importers.get(field)
        if importer is None:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"this worker cannot import {transport_name(field)} payloads (no importer for {field!r}"
                f"{'; it has no GPU' if field == 'cuda_ipc' and not self.service.own_device.is_cuda else ''})",
                transport=field,
            )
        expected_kind = _HANDLE_KIND.get(field)
        if expected_kind is not None and sel.device.kind != expected_kind:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"a {transport_name(field)} handle cannot live on device {sel.device}; label it with the device that holds it",
                transport=field,
            )
        importer.check(sel.payload)
        # 4. Open (once per handle per update), check the real size, verify, view, load.
        t_open = time.perf_counter_ns()
        mapping, opened = self._open(importer, sel.payload, sel)
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
                        f"bucket {msg.index}: CRC-32 of the payload is {actual:#010x}, the sender said {checksum:#010x}",
                        bucket=str(msg.index),
                    )
            t_load = time.perf_counter_ns()
            views = list(zip(layout.owned_names, strided_views(mapping, layout.views), strict=True))
            self._loaded_any = True
            try:
                self.service.adapter.load(views)
            except WeightwireError:
                raise
            except Exception as e:
                raise WeightwireError(
                    Reason.LOAD_FAILED, f"the engine failed to load bucket {msg.index}: {e!r}", bucket=str(msg.index)
                ) from e
            finally:
                del views
            load_ns = time.perf_counter_ns() - t_load
        finally:
            if mapping not in self._mappings.values():
                # Not shared within this update: done with it (a reusable importer keeps its cache).
                mapping.close()
        nbytes = layout.owned_bytes
        self._loaded.update(layout.owned_names)
        self._bytes_loaded += nbytes
        if opened:
            self._handles_opened += 1
        ack.tensors_loaded = len(owned)
        ack.bytes_loaded = nbytes
        ack.source_device.CopyFrom(sel.device.to_proto())
        ack.transport = importer.transport  # type: ignore[assignment]
        ack.peer_device_import = sel.peer
        ack.handle_opened = opened
        ack.open_duration_ns = open_ns
        ack.load_duration_ns = load_ns
        return ack

    def _check_layout(self, msg: pb.Bucket, payloads: list[pb.Payload]) -> _BucketLayout:
        """The update-independent checks of one bucket, in the order the rules apply; raises on the first failure."""
        specs = [check_spec(s) for s in msg.tensors]
        names_here: set[str] = set()
        for spec in specs:
            if spec.name in names_here or spec.name in self._names_seen:
                raise WeightwireError(
                    Reason.DUPLICATE_TENSOR, f"tensor {spec.name!r} arrived twice in this update", tensor=spec.name
                )
            names_here.add(spec.name)
        if specs and not payloads:
            raise WeightwireError(
                Reason.PAYLOAD_COUNT_MISMATCH,
                f"bucket {msg.index} describes {len(specs)} tensors but carries no payload",
                bucket=str(msg.index),
            )
        for i, payload in enumerate(payloads):
            check_payload_size(payload, i)
            if payload.WhichOneof("handle") is None:
                raise WeightwireError(
                    Reason.HANDLE_MISSING, f"payload {i} of bucket {msg.index} has no handle (cuda_ipc, host_shm or inline_data)"
                )
            for spec in specs:
                check_in_bounds(spec, payload.size_bytes)
        # The checksum's own checks come next in the rule order; they depend on the header, so they
        # run per update, but a bad checksum field must still win over the ownership checks below.
        self._checked_checksum(msg)
        # 2. Ownership: keep only tensors in this worker's manifest; they must match it exactly.
        owned: list[CheckedSpec] = []
        for spec in specs:
            expected = self._manifest.tensors.get(spec.name)
            if expected is not None:
                check_against_manifest(spec, expected)
                owned.append(spec)
        return _BucketLayout(
            specs=tuple(specs),
            names=frozenset(names_here),
            owned=tuple(owned),
            owned_names=tuple(s.name for s in owned),
            views=tuple(ViewItem.of(s.offset_bytes, s.torch_dtype, s.shape) for s in owned),
            owned_bytes=sum(s.nbytes for s in owned),
        )

    def _checked_checksum(self, msg: pb.Bucket) -> int | None:
        if not self.header.verify_checksums or not msg.HasField("checksum"):
            return None
        if msg.checksum.algorithm != pb.CHECKSUM_ALGORITHM_CRC32:
            raise WeightwireError(
                Reason.INVALID_CHECKSUM,
                f"bucket {msg.index}: checksum algorithm {msg.checksum.algorithm} is unspecified or unknown; use CHECKSUM_ALGORITHM_CRC32",
            )
        if not 0 <= msg.checksum.value < 2**32:
            raise WeightwireError(Reason.INVALID_CHECKSUM, f"bucket {msg.index}: CRC-32 value {msg.checksum.value} is out of range")
        return msg.checksum.value

    def _open(self, importer: PayloadImporter, payload: pb.Payload, sel: Selection) -> tuple[ImportedPayload, bool]:
        ctx = ImportContext(own_device=self.service.own_device, source=sel.device, peer=sel.peer, target=self.service.target_device)
        key = None if importer.reusable else importer.cache_key(payload)
        if key is not None and key in self._mappings:
            return self._mappings[key], False
        try:
            mapping, opened = importer.open(payload, ctx)
        except WeightwireError:
            raise
        except Exception as e:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, f"opening the {transport_name(importer.field_name)} payload failed: {e!r}") from e
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

    def _commit(self, msg: pb.UpdateCommit) -> pb.UpdateResult:
        received = len(self._bucket_indices)
        if msg.bucket_count != received:
            raise WeightwireError(
                Reason.BUCKET_COUNT_MISMATCH,
                f"commit says {msg.bucket_count} buckets were sent but this worker received {received}",
                expected=str(msg.bucket_count),
                received=str(received),
            )
        if self.header.scope == pb.UPDATE_SCOPE_FULL:
            missing = sorted(set(self._manifest.tensors) - self._loaded)
            if missing:
                raise WeightwireError(
                    Reason.INCOMPLETE_UPDATE,
                    f"a FULL update must deliver every tensor this worker owns; {len(missing)} of "
                    f"{len(self._manifest.tensors)} missing: {name_list(missing)}",
                    missing=bounded_join(missing),
                    missing_count=str(len(missing)),
                )
        self._close_mappings()
        try:
            self.service.adapter.end_update(True)
        except Exception as e:
            self._loaded_any = True  # the engine may have half-finished post-processing
            raise WeightwireError(Reason.LOAD_FAILED, f"the engine failed to finish update {self.version}: {e!r}") from e
        with self._finish_lock:
            self.finished = True
        if self.header.scope == pb.UPDATE_SCOPE_FULL or self.prior_state == pb.WORKER_STATE_CONSISTENT:
            new_state = pb.WORKER_STATE_CONSISTENT
        else:
            new_state = pb.WORKER_STATE_INCONSISTENT
        result = pb.UpdateResult(
            version=self.version,
            previous_version=self.service.weights_version,
            scope=self.header.scope,
            bucket_count=len(self._bucket_indices),
            tensors_loaded=len(self._loaded),
            bytes_loaded=self._bytes_loaded,
            handles_opened=self._handles_opened,
            duration_ns=time.perf_counter_ns() - self._t0,
            state=new_state,  # type: ignore[arg-type]
            update_id=self.header.update_id,
            finish_time=_now(),
        )
        self.service._finish(self, new_state=new_state, result=result, err=None)
        try:
            if self.service.on_commit is not None:
                # Still the active update: no other push can change the model while this runs.
                self.service.on_commit(result)
        except Exception:
            log.exception("on_commit hook failed after update %d", self.version)
        finally:
            self.service._release(self)
        return result
