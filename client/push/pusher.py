"""``WeightPusher``: the trainer-side streaming client.

A trainer calls, in a few lines::

    with WeightPusher(["unix:/run/ww/tp0.sock", "unix:/run/ww/tp1.sock"]) as pusher:
        results = pusher.push(model.named_parameters(), version=step)

One update runs as: fetch (cached) manifests of every worker concurrently -> check names, dtypes,
shapes and FULL coverage against them (``weightwire.client.inputs.plan``) -> re-check each worker's
manifest fingerprint and instance id -> open one PushWeights stream per worker -> pack buckets into
bounded staging buffers (double-buffered: bucket k+1 is packed while workers copy bucket k) and send
each only to the workers that own something in it -> reuse a buffer only after every worker that
got it acked -> once all buckets are acked, commit on every worker -> one ``PushResult`` per worker,
or one ``PushError`` naming each failed worker (the others' streams are cancelled at the first
failure).

Lower-level entry points: ``push_flat`` (already-flat buffers plus their specs, exported in place
when the transport can, e.g. a buffer from ``host_buffer``) and ``push_gathered`` (buckets carrying
several labelled payloads, e.g. one per trainer GPU after a gather; each worker picks its own).

Each entry point is the same three steps: shared setup (manifests, the re-check on its way, the
exporter) -> jobs (``weightwire.client.update.jobs``: planning checks, one job per bucket) -> one
``weightwire.client.update.session.UpdateSession`` that streams them and blames failures
(``weightwire.client.update.blame``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import (
    CastTo,
    check_cast_to,
    has_dtensors,
    local_device,
    named_items,
    source_device,
)
from weightwire.client.inputs.types import (
    FlatBucket,
    GatheredBucket,
    ProgressFn,
    PushProgress,
    PushResult,
    Scope,
)
from weightwire.client.rpc.calls import Worker, call_metadata, close_workers, collect_unary, start_unary
from weightwire.client.rpc.stream import Connections, WorkerStream
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.transfer_group import GroupExporter, TransferGroupOptions
from weightwire.client.transports.transfer_group_link import GroupLink
from weightwire.client.update import jobs as job_builders
from weightwire.client.update.one_rank import OneRankItems
from weightwire.client.update.options import PushOptions, scope_value
from weightwire.client.update.routing import CheckedLayouts, flat_bytes, manifest_changes, route_own_device
from weightwire.client.update.session import CommitGate, SpecTemplates, UpdateSession, open_streams
from weightwire.client.update.setup import PushSetup, recheck_needed, updating_workers
from weightwire.client.update.staging import Staging, StagingPool
from weightwire.core.delta import BaseKeeper
from weightwire.core.errors import PushError, Reason
from weightwire.core.kept_threads import KeptThreads
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.observe.trainer_metrics import TrainerMetrics
    from weightwire.client.ranks.transfer_group_sources import SourcesLink


def _close_all(staging: Staging, workers: list[Worker], readers: KeptThreads) -> None:
    # Not waiting for the readers: closing the channels below ends any call a thread is still blocked in.
    readers.shutdown()
    staging.close()
    close_workers(workers)


class WeightPusher:
    """Pushes weight updates to a set of engine workers (one endpoint per worker process).

    ``timeout_s`` is the deadline of every RPC, including one whole update stream.
    ``bucket_size_bytes`` bounds a staging buffer (inline buckets are bounded under the gRPC message
    limit instead); left out, host transports pack 64 MiB buckets and a GPU push that must pack
    (``cast_to``, ``verify_checksums``, tensors not on the GPU) up to 1 GiB, while CUDA tensors
    sent to workers that read them where they live are not packed at all. ``transport`` is ``"auto"`` or the name of a row of the transport table
    (``weightwire.core.transports.table``: ``cuda_ipc``, ``host_shm``, ``inline``). ``recheck_manifests``
    re-reads every worker's fingerprint and instance id (GetStatus, concurrently) before each
    update of several workers, to refuse a plan made against a worker that has since restarted
    before any other worker loads a byte; every worker checks the header's fingerprint (which
    covers its instance id) too, which is all an update of one worker needs. ``metrics`` (a
    ``weightwire.client.observe.trainer_metrics.TrainerMetrics``) records every push's durations (plan,
    transfer, commit; per worker) for Prometheus.
    ``transfer_group`` (``weightwire.client.transports.transfer_group.TransferGroupOptions``) moves the bytes over a
    torch.distributed group between machines instead (docs/distributed.md); it is then the
    transport ``"auto"`` picks.
    ``fresh_pool_bytes`` bounds the GPU buffers a CUDA IPC push packs fresh tensors into (tensors
    in new storages every step, such as gathered or converted ones: docs/client.md, "Fresh tensors
    and the buffer pool"); left out, the pool holds at most the bytes it packs (one copy of them),
    and 0 shares every fresh storage anew instead.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        timeout_s: float = 60.0,
        bucket_size_bytes: int | None = None,
        transport: str = "auto",
        align_bytes: int = planning.DEFAULT_ALIGN_BYTES,
        pipeline_depth: int = 2,
        recheck_manifests: bool = True,
        metrics: TrainerMetrics | None = None,
        transfer_group: TransferGroupOptions | None = None,
        fresh_pool_bytes: int | None = None,
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
        self.transport = transport
        self.align_bytes = int(align_bytes)
        self.recheck_manifests = recheck_manifests
        self.metrics = metrics
        self._metadata = call_metadata(token)
        self._workers = {a: Worker(a, tls_ca=tls_ca) for a in self.endpoints}
        self._manifests: dict[str, ShardManifest] | None = None
        self._fingerprints: dict[str, str] = {}
        self._staging = Staging(
            int(bucket_size_bytes) if bucket_size_bytes is not None else planning.DEFAULT_BUCKET_BYTES,
            max(1, int(pipeline_depth)),
            bucket_size_given=bucket_size_bytes is not None,
            fresh_pool_bytes=None if fresh_pool_bytes is None else max(0, int(fresh_pool_bytes)),
        )
        self._templates = SpecTemplates()
        self._one_rank = OneRankItems()
        self._checked = CheckedLayouts()
        self._push_lock = threading.Lock()
        self._closed = False
        # What ``push(delta=True)`` last sent (weightwire.client.update.delta): empty until then;
        # set ``delta_keeper.device_budget_bytes`` to keep copies of CUDA tensors on their device.
        self.delta_keeper = BaseKeeper()
        # The threads that read the update streams are kept across updates: a thread start per
        # worker per update is a large share of a small update's cost on a busy host. Room for a
        # reader still ending after a cancelled update next to the next update's readers.
        self._readers = KeptThreads(2 * len(self.endpoints) + 2, "ww-push")
        # Bytes over a torch.distributed group between machines (weightwire.client.transports.transfer_group):
        # formed at the first push, reused while every worker still holds it.
        self._group = (
            GroupLink(transfer_group, self._workers, self._metadata, self.timeout_s)
            if transfer_group is not None
            else None
        )
        # The group of every trainer rank of a multi-rank push (weightwire.client.ranks.slice_push).
        self._sources: SourcesLink | None = None
        if self._group is not None:
            # This pusher's group is the transfer-group transport's: its exporter routes over it.
            self._staging.add_exporter(GroupExporter(self._group))
            if transport == "auto":
                self.transport = "transfer_group"
        # Segments are unlinked even if the caller forgets close() (also at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _close_all, self._staging, list(self._workers.values()), self._readers
        )

    @property
    def bucket_size_bytes(self) -> int:
        return self._staging.bucket_size_bytes

    @property
    def pipeline_depth(self) -> int:
        return self._staging.pipeline_depth

    # ---------------------------------------------------------------- context, lifecycle

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink every staging segment and close the channels. Idempotent."""
        self._closed = True
        if self._sources is not None:
            self._sources.close()
        if self._group is not None:
            self._group.close()  # leave the transfer group first
        self._staging.close_user_buffers()
        self._finalizer()

    # ---------------------------------------------------------------- manifests and status

    def _start_all(self, method: str, request: object) -> dict[str, grpc.Future]:
        return start_unary(self._workers, method, request, timeout_s=self.timeout_s, metadata=self._metadata)

    def manifests(self, *, refresh: bool = False) -> dict[str, ShardManifest]:
        """Every worker's shard manifest (fetched concurrently, then cached), keyed by endpoint."""
        if self._manifests is None or refresh:
            responses = collect_unary("GetManifest", self._start_all("GetManifest", pb.GetManifestRequest()))
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
        return collect_unary("GetStatus", self._start_all("GetStatus", pb.GetStatusRequest()))  # type: ignore[return-value]

    def _push_slices(
        self, items: list[tuple[str, torch.Tensor]], options: PushOptions, group: Any
    ) -> dict[str, PushResult]:
        from weightwire.client.ranks.slice_push import push_slices
        from weightwire.client.ranks.transfer_group_sources import SourcesLink

        assert self._group is not None
        if self._sources is None:
            # On the single-source link's store: one listening socket, however the pushes alternate.
            self._sources = SourcesLink(
                self._group.options, self._workers, self._metadata, self.timeout_s, self._group.store
            )
        link = self._sources
        if self._group.group_id is not None:
            # The workers were last told to join this pusher's single-source group, leaving the
            # one of every rank: both are stale now (this rank's held group then differs from the
            # others', so every rank forms a new one together).
            self._group.teardown("a multi-rank push forms its own group", leave=False)
            link.teardown("the workers joined this pusher's single-source group since")
        if self.metrics is not None:
            options = dataclasses.replace(options, metrics=self.metrics)
        connections = Connections(self._workers, self._metadata, self.timeout_s, self._readers)

        def read_manifests() -> tuple[dict[str, ShardManifest], dict[str, str]]:
            # Read again whenever no group is formed (the first push, or after a failed one): a
            # restarted worker then joins the new group instead of failing the update.
            manifests = self.manifests(refresh=link.group_id is None)
            return manifests, dict(self._fingerprints)

        return push_slices(link, connections, read_manifests, items, options, group=group)

    def leave_transfer_group(self) -> None:
        """Tear the transfer group down on this side and on every worker (the next push forms a new one)."""
        if self._group is not None:
            self._group.teardown("left on request")

    @property
    def transfer_group_id(self) -> str | None:
        """The id of the transfer group now formed, or None."""
        return self._group.group_id if self._group is not None else None

    def _recheck(
        self, manifests: Mapping[str, ShardManifest], pending: Mapping[str, grpc.Future] | None
    ) -> Mapping[str, pb.GetStatusResponse]:
        """Refuse the update (nothing sent) when a worker restarted or changed since its manifest was read."""
        statuses: Mapping[str, pb.GetStatusResponse] = (
            collect_unary("GetStatus", pending) if pending is not None else self.status()  # type: ignore[assignment]
        )
        changed = manifest_changes(statuses, manifests, self._fingerprints)
        if changed:
            self._manifests = None
            raise PushError(dict(changed))
        return statuses

    # ---------------------------------------------------------------- buffers the caller fills

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor in host shared memory, for ``push_flat``/``push_gathered`` with
        no packing copy (e.g. gather into it). It lives until ``close()``."""
        return self._staging.host_buffer(nbytes)

    def export_payload(self, flat: torch.Tensor, size_bytes: int | None = None) -> pb.Payload:
        """Export a local flat buffer in place as a labelled ``Payload`` (no copy), e.g. for a trainer
        rank that hands its payload to the rank calling ``push_gathered`` (send
        ``payload.SerializeToString()``; the receiver parses it with ``Payload.FromString``).

        CPU buffers must come from ``host_buffer``; CUDA buffers go through CUDA IPC. The buffer must
        stay alive and unchanged until the push that carries the payload returned.
        """
        return self._staging.export_in_place(flat_bytes(flat, "export_payload"), size_bytes)

    def tensor_buffers(
        self,
        like: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors to write a push's values into, one per name of ``like`` with its shape and dtype
        (a DTensor's full shape; ``like`` may be on the meta device), as views of one allocation
        on ``device`` (default: the device of ``like``'s first tensor not on the meta device, else the
        current GPU).

        A trainer that produces its tensors for each push (a gather, a conversion, a cast) writes
        them here instead (``out=``, ``copy_``) and pushes the dict: the same storage every step, so
        from its second push on it goes where it lives with no packing copy, as a trainer's kept
        parameters do.
        The caller owns the memory (one copy of the tensors); the values must stay unchanged until
        ``push`` returned, and may be overwritten after.
        """
        items = named_items(like)
        if device is None:
            local = [local_device(t) for _, t in items if t.device.type != "meta"]
            device = local[0] if local else torch.device("cuda", torch.cuda.current_device())
        target = torch.device(device)
        places: list[tuple[str, torch.dtype, torch.Size, int]] = []
        end = 0
        for name, t in items:
            at = planning.align_up(end, self.align_bytes)
            shape = torch.Size(t.shape)
            places.append((name, t.dtype, shape, at))
            end = at + shape.numel() * t.dtype.itemsize
        flat = torch.empty(max(end, 1), dtype=torch.uint8, device=target)
        return {
            name: flat.narrow(0, at, shape.numel() * dtype.itemsize).view(dtype).view(shape)
            for name, dtype, shape, at in places
        }

    # ---------------------------------------------------------------- entry points

    def push(  # noqa: PLR0913 (one keyword per documented option)
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
        cast_to: CastTo = None,
        group: object | None = None,
        routing: str = "own_device",
        sender_rank: int = 0,
        delta: bool = False,
    ) -> dict[str, PushResult]:
        """Push checkpoint-named tensors as weights ``version``; one result per worker.

        Raises ``PlanError`` before sending anything when names, dtypes, shapes or FULL coverage do
        not fit the manifests, and ``PushError`` when any worker failed (naming each). With
        ``only_own_device`` the update goes only to workers on the device this process exports from
        (a colocated trainer rank pushing to its own GPU's workers). ``cast_to`` (a dtype for every
        floating-point tensor, or a ``{from: to}`` map) converts on the way, e.g. fp32 master weights
        into a bf16 engine; without it a dtype the workers do not expect is a ``DTYPE_MISMATCH``.

        DTensors (FSDP2 ``state_dict()``/``named_parameters()``), or any tensors with ``group`` (a
        ``torch.distributed`` process group), make this one update of every rank of that group: each
        rank runs the same call and the library gathers each bucket on the group, decides who sends
        what (``routing="own_device"``: each rank streams to the workers on its own device;
        ``"gathered"``: rank ``sender_rank`` streams every bucket with every device's payload) and
        commits on every worker only when every rank's workers acked everything. Every rank returns
        the same results or raises the same error (``weightwire.client.ranks.collective_push``).

        ``delta``: send only what changed since the last push every worker committed, falling back
        to a whole update by itself (each result's ``encoding`` and ``delta_fallback`` say which and
        why; ``weightwire.client.update.delta``, docs/deltas.md).
        """
        check_cast_to(cast_to)
        options = PushOptions(
            version,
            scope_value(scope),
            allow_unowned=allow_unowned,
            verify_checksums=verify_checksums,
            only_own_device=only_own_device,
            progress=progress,
            update_id=update_id,
            cast_to=cast_to,
        )
        items = named_items(named_tensors)
        ranked = group is not None or has_dtensors(items)
        if ranked:
            # One trainer rank: nothing to agree on or gather, so the plain push (and its fast paths).
            single = self._one_rank.items(items, group)
            if single is not None:
                items, group, ranked = single, None, False
        if delta and not ranked:
            from weightwire.client.update.delta import push_delta

            return push_delta(self, items, options, ranked=ranked, source=source_device(items))
        if delta:
            self.delta_keeper.drop()
            options = dataclasses.replace(options, delta_fallback=pb.DELTA_FALLBACK_TRANSPORT)
        if ranked:
            from weightwire.client.inputs.dtensor_gather import default_group

            if self._group is not None:
                # Every trainer rank a source, every worker receiving only its slices.
                return self._push_slices(items, options, group if group is not None else default_group(items))
            from weightwire.client.ranks import collective_push

            return collective_push.push_from_ranks(
                RankedPushDriver(self),
                items,
                options,
                group=group if group is not None else default_group(items),
                routing=routing,
                sender_rank=sender_rank,
            )
        return self._push_items(items, options)

    def _push_items(
        self, items: list[tuple[str, torch.Tensor]], options: PushOptions
    ) -> dict[str, PushResult]:
        """One trainer rank's ``push`` of ``items`` once its options are made."""
        source = source_device(items)
        setup, exporter = self._setup_exporting(source, options)
        # CUDA tensors exported where they live go as one bucket (per group of recipients).
        in_place = job_builders.exports_in_place(items, setup.manifests, exporter, options)
        one_bucket = in_place or sum(t.nbytes for _, t in items) <= self.bucket_size_bytes
        with self._opened_early(setup, options, one_bucket=one_bucket) as opened:
            jobs = job_builders.tensor_jobs(
                items, setup.manifests, exporter, self._staging, options, self.align_bytes, in_place=in_place
            )
            # Only a transport that routes each update sends from the caller's tensors by name.
            sources = dict(items) if exporter.routes_each_update else None
            return self._run(setup, jobs, options, opened=opened, sources=sources)

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
        options = PushOptions(
            version,
            scope_value(scope),
            allow_unowned=allow_unowned,
            verify_checksums=verify_checksums,
            only_own_device=only_own_device,
            progress=progress,
            update_id=update_id,
        )
        source = next(
            (b.buffer.device for b in buckets if b.buffer.device.type != "cpu"), torch.device("cpu")
        )
        setup, exporter = self._setup_exporting(source, options)
        with self._opened_early(setup, options, one_bucket=len(buckets) == 1) as opened:
            jobs = job_builders.flat_jobs(
                buckets, setup.manifests, exporter, self._staging, options, self._checked
            )
            return self._run(setup, jobs, options, opened=opened)

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
        options = PushOptions(
            version,
            scope_value(scope),
            allow_unowned=allow_unowned,
            verify_checksums=verify_checksums,
            allow_peer_device_import=allow_peer_device_import,
            precheck_labels=precheck_labels,
            progress=progress,
            update_id=update_id,
        )
        setup = self._setup()
        with self._opened_early(setup, options, one_bucket=len(buckets) == 1) as opened:
            jobs = job_builders.gathered_jobs(buckets, setup.manifests, self._staging, options)
            return self._run(setup, jobs, options, opened=opened)

    # ---------------------------------------------------------------- shared setup and the update

    def _setup(
        self, manifests: dict[str, ShardManifest] | None = None, exporter: exp.Exporter | None = None
    ) -> PushSetup:
        manifests = self.manifests() if manifests is None else manifests
        # Started now so that it overlaps planning.
        needed = self.recheck_manifests and recheck_needed(manifests, exporter)
        recheck = self._start_all("GetStatus", pb.GetStatusRequest()) if needed else None
        return PushSetup(manifests, recheck, exporter=exporter)

    def _setup_exporting(self, source: torch.device, options: PushOptions) -> tuple[PushSetup, exp.Exporter]:
        """``_setup`` plus the exporter for ``source`` (``transport``, or the one ``auto`` picks for
        these workers), keeping only the workers on its device with ``only_own_device``."""
        manifests = self.manifests()
        name = self.transport
        if name == "auto":
            name = exp.choose_transport([m.device for m in manifests.values()], source)
        exporter = self._staging.exporter(name, source)
        setup = self._setup(manifests, exporter)
        setup.manifests = route_own_device(setup.manifests, exporter, options.only_own_device)
        return setup, exporter

    @contextlib.contextmanager
    def _opened_early(
        self, setup: PushSetup, options: PushOptions, *, one_bucket: bool
    ) -> Iterator[dict[str, WorkerStream] | None]:
        """Each worker's stream opened before the update is planned (``session.open_streams``), and
        cancelled (nothing sent; the workers record nothing) if the push ends before a session took
        them over. Not for a transport that routes each update (a transfer group), whose route may
        still change the workers, and not for
        one bucket to one worker (``one_bucket``: likely one), which goes out as one PushUpdate call
        once it is ready (``UpdateSession.run``): cheaper than any stream."""
        routes = setup.exporter is not None and setup.exporter.routes_each_update
        if self._closed or routes or self._push_lock.locked() or (one_bucket and len(setup.manifests) == 1):
            yield None
            return
        connections = Connections(self._workers, self._metadata, self.timeout_s, self._readers)
        opened = open_streams(setup.manifests, options, connections, self._fingerprints)
        try:
            yield opened
        finally:
            for stream in opened.values():
                if not stream.adopted:
                    stream.cancel()

    def _run(
        self,
        setup: PushSetup,
        jobs: job_builders.Jobs,
        options: PushOptions,
        commit_gate: CommitGate | None = None,
        opened: Mapping[str, WorkerStream] | None = None,
        sources: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, PushResult]:
        if self._closed:
            raise RuntimeError("this WeightPusher is closed")
        if not self._push_lock.acquire(blocking=False):
            raise RuntimeError("a push is already running on this WeightPusher; one update at a time")
        if self.metrics is not None:
            options = dataclasses.replace(options, metrics=self.metrics)
        try:
            statuses = None
            if setup.recheck is not None and not setup.rechecked:
                if recheck_needed(setup.manifests, setup.exporter):
                    statuses = self._recheck(setup.manifests, setup.recheck)
                else:  # routing left one worker (only_own_device): its header check is enough
                    for call in setup.recheck.values():
                        call.cancel()
            exporter = setup.exporter
            if exporter is not None:
                routed = exporter.route_update(
                    jobs.jobs, setup.manifests, statuses, sources, verify_checksums=options.verify_checksums
                )
                jobs = job_builders.Jobs(routed, jobs.pools)
            connections = Connections(self._workers, self._metadata, self.timeout_s, self._readers)
            session = UpdateSession(
                jobs.jobs,
                setup.manifests,
                options,
                connections,
                self._fingerprints,
                self._templates,
                jobs.pools,
                commit_gate,
                updating_before=updating_workers(statuses),
                opened=opened,
                whole_update=setup.exporter is None or not setup.exporter.routes_each_update,
            )
            # Staging buffers hand workers an event to wait for instead of waiting for their own
            # writes, when every recipient says it waits for it. Not in a push of several ranks
            # (commit_gate): a rank's payloads also go to the sending rank's workers.
            waits = commit_gate is None and all(m.waits_for_cuda_ipc_events for m in setup.manifests.values())
            with exp.consumers_wait_for_events(waits):
                return session.run()
        except PushError as e:
            if any(err.kind is Reason.MANIFEST_CHANGED for err in e.failures.values()):
                self._manifests = None
            if setup.exporter is not None and setup.exporter.update_failed(e.failures):
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


class RankedPushDriver:
    """What a push made by several trainer ranks together (``weightwire.client.ranks.collective_push``)
    uses of its ``WeightPusher``: the seam between one rank's lifecycle of an update and the ranks'
    lockstep, so that the multi-rank driver reaches no private member of the pusher.

    ``prepare`` reads the manifests, picks the exporter for ``source`` and re-checks the workers
    before the ranks agree (a restarted worker fails every rank before a byte moves); ``run`` runs
    this rank's share of the update on the workers it streams to, with the ranks' commit gate.
    """

    def __init__(self, pusher: WeightPusher) -> None:
        self._pusher = pusher
        self.endpoints: Sequence[str] = pusher.endpoints
        self.timeout_s = pusher.timeout_s
        self.pipeline_depth = pusher.pipeline_depth
        self.bucket_size_bytes = pusher.bucket_size_bytes
        self.align_bytes = pusher.align_bytes

    def prepare(self, source: torch.device, options: PushOptions) -> tuple[PushSetup, exp.Exporter]:
        pusher = self._pusher
        setup, exporter = pusher._setup_exporting(source, dataclasses.replace(options, only_own_device=False))
        if pusher.recheck_manifests:
            pusher._recheck(setup.manifests, setup.recheck)
        setup.recheck = None
        setup.rechecked = True
        return setup, exporter

    @property
    def fingerprints(self) -> Mapping[str, str]:
        """The workers' manifest fingerprints the update was planned against."""
        return dict(self._pusher._fingerprints)

    def staging_pool(self, exporter: exp.Exporter, bucket_bytes: int) -> StagingPool:
        return self._pusher._staging.pool(exporter, bucket_bytes)

    def run(
        self,
        setup: PushSetup,
        workers: Sequence[str],
        jobs: job_builders.Jobs,
        options: PushOptions,
        commit_gate: CommitGate,
    ) -> dict[str, PushResult]:
        """This rank's streams to ``workers`` (a subset of ``setup``'s), committed only when
        ``commit_gate`` (every rank's agreement) lets them."""
        sub = dataclasses.replace(
            setup, manifests={a: setup.manifests[a] for a in workers}, recheck=None, rechecked=True
        )
        return self._pusher._run(sub, jobs, options, commit_gate=commit_gate)
