"""``WeightPusher``: the trainer-side streaming client.

A trainer calls, in a few lines::

    with WeightPusher(["unix:/run/ww/tp0.sock", "unix:/run/ww/tp1.sock"]) as pusher:
        results = pusher.push(model.named_parameters(), version=step)

One update runs as: fetch (cached) manifests of every worker concurrently -> check names, dtypes,
shapes and FULL coverage against them (``weightwire.client.plan``) -> re-check each worker's
manifest fingerprint and instance id -> open one PushWeights stream per worker -> pack buckets into
bounded staging buffers (double-buffered: bucket k+1 is packed while workers copy bucket k) and send
each only to the workers that own something in it -> reuse a buffer only after every worker that
got it acked -> once all buckets are acked, commit on every worker -> one ``PushResult`` per worker,
or one ``PushError`` naming each failed worker (the others' streams are cancelled at the first
failure).

Lower-level entry points: ``push_flat`` (already-flat buffers plus their specs, exported in place
when the transport can, e.g. a buffer from ``host_buffer``) and ``push_gathered`` (buckets carrying
several labelled payloads, e.g. one per trainer GPU after a gather; each worker picks its own).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence

import grpc
import torch
from weightwire.client import exporters as exp
from weightwire.client import plan as planning
from weightwire.client.plan import PlanError, TensorSpec
from weightwire.client.readers import ReaderThreads
from weightwire.client.routing import (
    CheckedLayouts,
    check_labels,
    check_transport_limit,
    flat_bytes,
    label_str,
    recipients_of,
    route_own_device,
    scope_value,
)
from weightwire.client.rpc import Worker, call_metadata, error_from_rpc
from weightwire.client.session import run_update
from weightwire.client.staging import Job, SpecTemplates, StagingPool, flat_exporter_job, gathered_job, packer
from weightwire.client.types import FlatBucket, GatheredBucket, ProgressFn, PushProgress, PushResult, Scope
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb


def _close_all(
    pools: dict[str, StagingPool],
    exporters: dict[str, exp.Exporter],
    workers: list[Worker],
    executors: list[ReaderThreads],
) -> None:
    for ex in executors:
        # Not waiting: closing the channels below ends any call a thread is still blocked in.
        ex.shutdown()
    for pool in pools.values():
        pool.close()
    for exporter in exporters.values():
        exporter.close()
    for w in workers:
        w.close()


class WeightPusher:
    """Pushes weight updates to a set of engine workers (one endpoint per worker process).

    ``timeout_s`` is the deadline of every RPC, including one whole update stream.
    ``bucket_size_bytes`` bounds a staging buffer (inline buckets are bounded under the gRPC message
    limit instead). ``transport`` is ``"auto"``, ``"host_shm"``, ``"inline"`` or a registered one
    (``"cuda_ipc"``). ``recheck_manifests`` re-reads every worker's fingerprint and instance id
    (GetStatus, concurrently) before each update, to refuse a plan made against a worker that has
    since restarted; the worker checks the header's fingerprint too.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        timeout_s: float = 60.0,
        bucket_size_bytes: int = planning.DEFAULT_BUCKET_BYTES,
        transport: str = "auto",
        align_bytes: int = planning.DEFAULT_ALIGN_BYTES,
        pipeline_depth: int = 2,
        recheck_manifests: bool = True,
    ) -> None:
        if not endpoints:
            raise ValueError("WeightPusher needs at least one worker endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"duplicate worker endpoints: {list(endpoints)}")
        if isinstance(tls_ca, str):
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        self.endpoints = list(endpoints)
        self.timeout_s = float(timeout_s)
        self.bucket_size_bytes = int(bucket_size_bytes)
        self.transport = transport
        self.align_bytes = int(align_bytes)
        self.pipeline_depth = max(1, int(pipeline_depth))
        self.recheck_manifests = recheck_manifests
        self._metadata = call_metadata(token)
        self._workers = {a: Worker(a, tls_ca=tls_ca) for a in self.endpoints}
        self._manifests: dict[str, ShardManifest] | None = None
        self._fingerprints: dict[str, str] = {}
        self._exporters: dict[str, exp.Exporter] = {}
        self._pools: dict[str, StagingPool] = {}
        self._templates = SpecTemplates()
        self._checked = CheckedLayouts()
        self._user_buffers: list[exp.StagingBuffer] = []
        self._push_lock = threading.Lock()
        self._closed = False
        # The threads that read the update streams are kept across updates: a thread start per
        # worker per update is a large share of a small update's cost on a busy host. Room for a
        # reader still ending after a cancelled update next to the next update's readers.
        self._readers = ReaderThreads(2 * len(self.endpoints) + 2, "ww-push")
        # Segments are unlinked even if the caller forgets close() (also at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _close_all, self._pools, self._exporters, list(self._workers.values()), [self._readers]
        )

    # ---------------------------------------------------------------- context, lifecycle

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink every staging segment and close the channels. Idempotent."""
        self._closed = True
        for buf in self._user_buffers:
            buf.close()
        self._user_buffers.clear()
        self._finalizer()

    # ---------------------------------------------------------------- manifests and status

    def _unary_all(self, method: str, request: object) -> dict[str, object]:
        """Call a unary RPC on every worker concurrently; raise one PushError for all failures."""
        return self._collect(method, self._start_all(method, request))

    def _start_all(self, method: str, request: object) -> dict[str, grpc.Future]:
        """Start a unary RPC on every worker; ``_collect`` waits for the answers."""
        return {
            a: getattr(w.stub, method).future(request, timeout=self.timeout_s, metadata=self._metadata)
            for a, w in self._workers.items()
        }

    def _collect(self, method: str, pending: Mapping[str, grpc.Future]) -> dict[str, object]:
        out: dict[str, object] = {}
        failures: dict[str, WeightwireError] = {}
        for a, fut in pending.items():
            try:
                out[a] = fut.result()
            except grpc.RpcError as e:
                failures[a] = error_from_rpc(e, worker=a, context=method)
        if failures:
            raise PushError(failures)
        return out

    def manifests(self, *, refresh: bool = False) -> dict[str, ShardManifest]:
        """Every worker's shard manifest (fetched concurrently, then cached), keyed by endpoint."""
        if self._manifests is None or refresh:
            responses = self._unary_all("GetManifest", pb.GetManifestRequest())
            manifests: dict[str, ShardManifest] = {}
            fingerprints: dict[str, str] = {}
            for a in self.endpoints:
                msg = responses[a].manifest  # type: ignore[attr-defined]
                manifests[a] = ShardManifest.from_proto(msg)
                fingerprints[a] = msg.fingerprint
            self._manifests, self._fingerprints = manifests, fingerprints
        return dict(self._manifests)

    def refresh_manifests(self) -> dict[str, ShardManifest]:
        return self.manifests(refresh=True)

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """Every worker's GetStatus (weights version, state, last result/error), keyed by endpoint."""
        return self._unary_all("GetStatus", pb.GetStatusRequest())  # type: ignore[return-value]

    def _start_recheck(self) -> dict[str, grpc.Future] | None:
        """Send the re-check's GetStatus to every worker now, so it travels while the push is planned.

        Only its answers are looked at, in ``_run`` after planning, before anything is sent; a planning
        error therefore still wins, and a worker that restarted is still caught before its header.
        """
        return self._start_all("GetStatus", pb.GetStatusRequest()) if self.recheck_manifests else None

    def _recheck(self, workers: Iterable[str], pending: Mapping[str, grpc.Future] | None = None) -> None:
        statuses: Mapping[str, pb.GetStatusResponse] = (
            self._collect("GetStatus", pending) if pending is not None else self.status()  # type: ignore[assignment]
        )
        changed: dict[str, WeightwireError] = {}
        for a in workers:
            st = statuses[a]
            planned = self._manifests[a] if self._manifests else None
            if planned is None:
                continue
            if st.manifest_fingerprint != self._fingerprints[a] or (planned.instance_id and st.instance_id != planned.instance_id):
                changed[a] = PlanError(
                    "MANIFEST_CHANGED",
                    f"worker {planned.worker_id or a} changed since its manifest was read (instance "
                    f"{planned.instance_id or '?'} -> {st.instance_id or '?'}, fingerprint "
                    f"{self._fingerprints[a][:12]} -> {st.manifest_fingerprint[:12]}): it restarted or "
                    "changed layout. Nothing was sent; the next push re-reads the manifests (make it a FULL update).",
                    code="FAILED_PRECONDITION",
                    worker=a,
                )
        if changed:
            self._manifests = None
            raise PushError(changed)

    # ---------------------------------------------------------------- staging

    def _exporter(self, name: str, source: torch.device) -> exp.Exporter:
        key = name if name in ("host_shm", "inline") else f"{name}:{source}"
        if key not in self._exporters:
            self._exporters[key] = exp.make_exporter(name, source)
        return self._exporters[key]

    def _pool(self, exporter: exp.Exporter, bucket_bytes: int) -> StagingPool:
        key = next(k for k, v in self._exporters.items() if v is exporter)
        pool = self._pools.get(key)
        if pool is None or pool.bucket_bytes != bucket_bytes:
            if pool is not None:
                pool.close()
            pool = self._pools[key] = StagingPool(exporter, bucket_bytes, self.pipeline_depth)
        return pool

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor in host shared memory, for ``push_flat``/``push_gathered`` with
        no packing copy (e.g. gather into it). It lives until ``close()``."""
        seg = self._exporter("host_shm", torch.device("cpu")).allocate(nbytes)
        self._user_buffers.append(seg)
        return seg.tensor()[:nbytes]

    def export_payload(self, flat: torch.Tensor, size_bytes: int | None = None) -> pb.Payload:
        """Export a local flat buffer in place as a labelled ``Payload`` (no copy), e.g. for a trainer
        rank that hands its payload to the rank calling ``push_gathered`` (send
        ``payload.SerializeToString()``; the receiver parses it with ``Payload.FromString``).

        CPU buffers must come from ``host_buffer``; CUDA buffers go through CUDA IPC. The buffer must
        stay alive and unchanged until the push that carries the payload returned.
        """
        raw = flat_bytes(flat, "export_payload")
        exporter = self._exporter("host_shm" if raw.device.type == "cpu" else "cuda_ipc", raw.device)
        staged = exporter.wrap(raw)
        if staged is None or exporter.label is None:
            raise PlanError(
                "HANDLE_MISSING",
                "export_payload needs a buffer from WeightPusher.host_buffer (CPU) or a CUDA tensor",
                code="INVALID_ARGUMENT",
            )
        if staged.base_offset_bytes:
            raise PlanError(
                "INVALID_OFFSET", "export_payload needs a buffer that starts at its allocation's first byte", code="INVALID_ARGUMENT"
            )
        staged.ready()
        size = raw.numel() if size_bytes is None else int(size_bytes)
        return exporter.export(staged, size, exporter.label)

    def _transport_for(self, manifests: Mapping[str, ShardManifest], source: torch.device) -> str:
        if self.transport != "auto":
            return self.transport
        return exp.choose_transport([m.device for m in manifests.values()], source)

    # ---------------------------------------------------------------- entry points

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        progress: ProgressFn | None = None,
        update_id: str = "",
        only_own_device: bool = False,
    ) -> dict[str, PushResult]:
        """Push checkpoint-named tensors as weights ``version``; one result per worker.

        Raises ``PlanError`` before sending anything when names, dtypes, shapes or FULL coverage do
        not fit the manifests, and ``PushError`` when any worker failed (naming each). With
        ``only_own_device`` the update goes only to workers on the device this process exports from
        (a colocated trainer rank pushing to its own GPU's workers).
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in items]
        source = next((t.device for _, t in items if t.device.type != "cpu"), torch.device("cpu"))
        manifests = self.manifests()
        recheck = self._start_recheck()
        exporter = self._exporter(self._transport_for(manifests, source), source)
        manifests = route_own_device(manifests, exporter, only_own_device)
        scope_pb = scope_value(scope)
        unknown = set(planning.check_update(specs, manifests, scope=scope_pb, allow_unowned=allow_unowned))
        check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")

        bucket_bytes = self.bucket_size_bytes
        if exporter.transport == pb.TRANSPORT_KIND_INLINE:
            bucket_bytes = min(bucket_bytes, exp.INLINE_BUCKET_BYTES)
        owners = planning.owners_by_name(manifests)
        plans = planning.plan_buckets(
            [s for s in specs if s.name not in unknown], owners, bucket_bytes=bucket_bytes, align_bytes=self.align_bytes
        )
        # plan_buckets indexes the filtered list; map back to the tensors.
        kept = [t for (name, t) in items if name not in unknown]
        check_transport_limit(exporter, [p.size_bytes for p in plans])
        pool = self._pool(exporter, bucket_bytes)

        jobs = [
            Job(
                list(p.specs),
                p.recipients,
                p.size_bytes,
                packer(pool, exporter, p, [kept[i] for i in p.items], verify_checksums),
            )
            for p in plans
        ]
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, False, progress, update_id, pool, recheck=recheck
        )

    def push_flat(
        self,
        buckets: Sequence[FlatBucket],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        progress: ProgressFn | None = None,
        update_id: str = "",
        only_own_device: bool = False,
    ) -> dict[str, PushResult]:
        """Push already-flat buffers with their tensor specs (no packing copy; exported in place
        when the transport can). Each bucket goes to the workers owning something in it."""
        all_specs = [s for b in buckets for s in b.specs]
        source = next((b.buffer.device for b in buckets if b.buffer.device.type != "cpu"), torch.device("cpu"))
        manifests = self.manifests()
        recheck = self._start_recheck()
        exporter = self._exporter(self._transport_for(manifests, source), source)
        manifests = route_own_device(manifests, exporter, only_own_device)
        scope_pb = scope_value(scope)
        # Byte sizes as ``_flat_bytes`` will see them (it only refuses, below, in the same order as ever).
        sizes = [b.buffer.numel() * b.buffer.element_size() for b in buckets]
        checked_key = self._checked.key(buckets, sizes, manifests, scope_pb, allow_unowned)
        routed = self._checked.get(checked_key)
        if routed is None:
            planning.check_update(all_specs, manifests, scope=scope_pb, allow_unowned=allow_unowned)
        check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")
        flats = [flat_bytes(b.buffer, f"flat bucket {i}") for i, b in enumerate(buckets)]
        if routed is None:
            owners = planning.owners_by_name(manifests)
            for i, (b, size) in enumerate(zip(buckets, sizes, strict=True)):
                planning.check_flat_specs(b.specs, size, f"flat bucket {i}")
            routed = [recipients_of(b.specs, owners, manifests) for b in buckets]
            self._checked.put(checked_key, buckets, manifests, routed)
        check_transport_limit(exporter, sizes)
        pool = self._pool(exporter, self.bucket_size_bytes)
        jobs: list[Job] = []
        for b, flat, recipients in zip(buckets, flats, routed, strict=True):
            if not recipients:
                continue
            jobs.append(
                Job(
                    list(b.specs),
                    recipients,
                    flat.numel(),
                    flat_exporter_job(pool, exporter, flat, list(b.specs), verify_checksums),
                )
            )
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, False, progress, update_id, pool, recheck=recheck
        )

    def push_gathered(
        self,
        buckets: Sequence[GatheredBucket],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        allow_peer_device_import: bool = False,
        precheck_labels: bool = True,
        progress: ProgressFn | None = None,
        update_id: str = "",
    ) -> dict[str, PushResult]:
        """Push buckets that each carry several labelled payloads (one per exporting device) to all
        workers owning something in them; every worker imports the payload labelled with its own
        device and nothing else.

        With ``precheck_labels`` (default) a worker whose device has no payload in a bucket it must
        receive is a ``PlanError`` before anything is sent; without it the worker refuses the
        bucket (NO_PAYLOAD_FOR_DEVICE) and the push fails with its status.
        """
        manifests = self.manifests()
        recheck = self._start_recheck()
        scope_pb = scope_value(scope)
        planning.check_update([s for b in buckets for s in b.specs], manifests, scope=scope_pb, allow_unowned=allow_unowned)
        owners = planning.owners_by_name(manifests)
        jobs: list[Job] = []
        pools: list[StagingPool] = []
        for i, b in enumerate(buckets):
            where = f"gathered bucket {i}"
            size = b.size_bytes if b.size_bytes is not None else max((s.offset_bytes + s.nbytes for s in b.specs), default=0)
            planning.check_flat_specs(b.specs, size, where)
            recipients = recipients_of(b.specs, owners, manifests)
            fixed: list[pb.Payload] = []
            local: list[tuple[exp.Exporter, torch.Tensor]] = []
            labels: list[DeviceRef] = []
            for p in b.payloads:
                if isinstance(p, pb.Payload):
                    if p.size_bytes < size:
                        raise PlanError("INVALID_SIZE", f"{where}: a payload labelled {label_str(p)} holds {p.size_bytes} bytes, the layout needs {size}", code="INVALID_ARGUMENT")
                    fixed.append(p)
                    labels.append(DeviceRef(p.device.kind, p.device.uuid))
                else:
                    flat = flat_bytes(p, where)
                    if flat.numel() < size:
                        raise PlanError("INVALID_SIZE", f"{where}: a local buffer holds {flat.numel()} bytes, the layout needs {size}", code="INVALID_ARGUMENT")
                    name = "host_shm" if flat.device.type == "cpu" else "cuda_ipc"
                    exporter = self._exporter(name, flat.device)
                    if exporter.label is None:
                        raise PlanError("PAYLOAD_LABEL_MISSING", f"{where}: transport {name} cannot label a local payload", code="INVALID_ARGUMENT")
                    local.append((exporter, flat))
                    labels.append(exporter.label)
            dupes = {str(lb) for lb in labels if labels.count(lb) > 1}
            if dupes:
                raise PlanError("DUPLICATE_PAYLOAD_LABEL", f"{where}: more than one payload labelled {', '.join(sorted(dupes))}", code="INVALID_ARGUMENT")
            if precheck_labels and recipients:
                check_labels({w: manifests[w] for w in recipients}, labels, where, allow_peer_device_import)
            if not recipients:
                continue
            job_pools = [self._pool(e, self.bucket_size_bytes) for e, _ in local]
            pools.extend(job_pools)
            jobs.append(
                Job(
                    list(b.specs),
                    recipients,
                    size,
                    gathered_job(fixed, list(zip(job_pools, local, strict=True)), size, verify_checksums),
                )
            )
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, allow_peer_device_import, progress, update_id, *pools,
            recheck=recheck,
        )


    def _run(
        self,
        jobs: list[Job],
        manifests: Mapping[str, ShardManifest],
        version: int,
        scope: int,
        verify_checksums: bool,
        allow_peer: bool,
        progress: ProgressFn | None,
        update_id: str,
        *pools: StagingPool,
        recheck: Mapping[str, grpc.Future] | None = None,
    ) -> dict[str, PushResult]:
        if self._closed:
            raise RuntimeError("this WeightPusher is closed")
        if not self._push_lock.acquire(blocking=False):
            raise RuntimeError("a push is already running on this WeightPusher; one update at a time")
        try:
            if self.recheck_manifests:
                self._recheck(manifests, recheck)
            return run_update(
                jobs, manifests, version, scope, verify_checksums, allow_peer, progress, update_id, pools,
                workers=self._workers,
                fingerprints=self._fingerprints,
                templates=self._templates,
                timeout_s=self.timeout_s,
                metadata=self._metadata,
                readers=self._readers,
            )
        except PushError as e:
            if any(err.reason == "MANIFEST_CHANGED" for err in e.failures.values()):
                self._manifests = None
            raise
        finally:
            self._push_lock.release()


__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "PushProgress",
    "PushResult",
    "WeightPusher",
]
