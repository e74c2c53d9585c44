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
(``weightwire.client.update.blame``). The first and the last are the pusher's base,
``weightwire.client.push.update_runner.UpdateRunner`` (the workers, their manifests and status, and
the run of one update); this module holds the entry points, what they choose between (one rank,
several ranks gathered or each a source, a delta) and the buffers a caller fills. A push of several
ranks that gathers drives the pusher through ``weightwire.client.push.ranked_driver``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import (
    CastTo,
    check_cast_to,
    local_device,
    named_items,
    named_items_and_dtensors,
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
from weightwire.client.push.ranked_driver import RankedPushDriver
from weightwire.client.push.update_runner import UpdateRunner
from weightwire.client.rpc.stream import Connections
from weightwire.client.transports.transfer_group import GroupExporter, TransferGroupOptions
from weightwire.client.transports.transfer_group_link import GroupLink
from weightwire.client.update import jobs as job_builders
from weightwire.client.update.one_rank import OneRankItems
from weightwire.client.update.options import PushOptions
from weightwire.client.update.routing import CheckedLayouts, flat_bytes
from weightwire.core.delta import BaseKeeper
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.observe.trainer_metrics import TrainerMetrics
    from weightwire.client.ranks.slice_deltas import SliceDeltas
    from weightwire.client.ranks.transfer_group_sources import SourcesLink


class WeightPusher(UpdateRunner):
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
        super().__init__(
            endpoints,
            token=token,
            tls_ca=tls_ca,
            timeout_s=timeout_s,
            bucket_size_bytes=bucket_size_bytes,
            transport=transport,
            align_bytes=align_bytes,
            pipeline_depth=pipeline_depth,
            recheck_manifests=recheck_manifests,
            metrics=metrics,
            fresh_pool_bytes=fresh_pool_bytes,
        )
        self._one_rank = OneRankItems()
        self._checked = CheckedLayouts()
        # What ``push(delta=True)`` last sent (weightwire.client.update.delta): empty until then;
        # set ``delta_keeper.device_budget_bytes`` to keep copies of CUDA tensors on their device.
        self.delta_keeper = BaseKeeper()
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

    # ---------------------------------------------------------------- transfer groups

    def _push_slices(
        self,
        items: list[tuple[str, torch.Tensor]],
        options: PushOptions,
        group: Any,
        deltas: SliceDeltas | None = None,
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

        return push_slices(
            link,
            connections,
            read_manifests,
            items,
            options,
            group=group,
            deltas=deltas,
            bucket_bytes=self.bucket_size_bytes,
        )

    def leave_transfer_group(self) -> None:
        """Tear the transfer group down on this side and on every worker (the next push forms a new one)."""
        if self._group is not None:
            self._group.teardown("left on request")

    @property
    def transfer_group_id(self) -> str | None:
        """The id of the transfer group now formed, or None."""
        return self._group.group_id if self._group is not None else None

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
        options = PushOptions.from_arguments(locals())
        items, dtensors = named_items_and_dtensors(named_tensors)
        ranked = group is not None or dtensors
        if ranked:
            # One trainer rank: nothing to agree on or gather, so the plain push (and its fast paths).
            single = self._one_rank.items(items, group)
            if single is not None:
                items, group, ranked = single, None, False
        if delta and not ranked:
            from weightwire.client.update.delta import push_delta

            return push_delta(self, items, options, ranked=ranked, source=source_device(items))
        if delta and self._group is not None:
            from weightwire.client.inputs.dtensor_gather import default_group
            from weightwire.client.ranks.slice_deltas import push_slices_delta

            # Every trainer rank a source, each diffing the regions it sends.
            return push_slices_delta(
                self, items, options, group if group is not None else default_group(items)
            )
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
        # One pass over the tensors (their device, layout, plan rows and storages), read by the rest.
        in_place = job_builders.exports_in_place(items, setup.manifests, exporter, options) or False
        one_bucket = bool(in_place) or sum(t.nbytes for _, t in items) <= self.bucket_size_bytes
        # Only a transport that routes each update sends from the caller's tensors by name.
        sources = dict(items) if exporter.routes_each_update else None
        return self._plan_and_run(
            setup,
            options,
            lambda: job_builders.tensor_jobs(
                items, setup.manifests, exporter, self._staging, options, self.align_bytes, in_place=in_place
            ),
            one_bucket=one_bucket,
            sources=sources,
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
        options = PushOptions.from_arguments(locals())
        source = next(
            (b.buffer.device for b in buckets if b.buffer.device.type != "cpu"), torch.device("cpu")
        )
        setup, exporter = self._setup_exporting(source, options)
        return self._plan_and_run(
            setup,
            options,
            lambda: job_builders.flat_jobs(
                buckets, setup.manifests, exporter, self._staging, options, self._checked
            ),
            one_bucket=len(buckets) == 1,
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
        options = PushOptions.from_arguments(locals())
        setup = self._setup()
        return self._plan_and_run(
            setup,
            options,
            lambda: job_builders.gathered_jobs(buckets, setup.manifests, self._staging, options),
            one_bucket=len(buckets) == 1,
        )


__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "PushProgress",
    "PushResult",
    "WeightPusher",
]
