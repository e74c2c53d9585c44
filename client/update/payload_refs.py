"""CUDA IPC payloads of several storages sent by name where a worker keeps them.

A trainer's parameters exported where they live go as one ``CudaIpcHandle`` with a share of every
storage (399 for an 8B model, ~45 KB), the same message every update while the parameters stay
where they are. Each such message carries a random ``storage_set_id``; a worker that keeps the set
says so in its ack (``BucketAck.storage_set_kept``), and from then on ``StorageSetRefs`` sends it
that payload as the name alone, which neither side then copies, serializes, parses or looks up by
its bytes. ``weightwire.client.update.session.UpdateSession`` asks it for each worker's payloads.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from weightwire.core.transports.cuda_ipc_storages import MAX_KEPT_STORAGE_SETS
from weightwire.v1 import weight_transfer_pb2 as pb

# A worker as far as what it keeps goes: its address, manifest fingerprint and instance (a
# restarted worker is another and keeps nothing).
WorkerKey = tuple[str, str, str]


class StorageSetRefs:
    """The storage sets each worker acked, and the payloads that name them.

    Only what a worker acked under its address, fingerprint and instance is named. A worker keeps
    at most ``MAX_KEPT_STORAGE_SETS`` sets (the oldest go first) and drops every other when it
    keeps one sent with ``storages_complete``; the names mirror that, so a name is sent only for a
    set the worker still keeps unless another trainer's sets pushed it out, which the worker
    refuses with STORAGE_SET_UNKNOWN before anything of the bucket loads (the pusher then sends
    the update again with the storages, having forgotten that worker's names).
    """

    _MAX_KNOWN = 256

    def __init__(self, *, enabled: bool = True) -> None:
        self._enabled = enabled
        self._kept: dict[WorkerKey, collections.OrderedDict[bytes, None]] = {}
        # storage_set_id -> (the whole payload's storages_complete, the payload naming it alone).
        self._known: dict[bytes, tuple[bool, pb.Payload]] = {}
        # Payloads sent as a name alone, over this object's life.
        self.payloads_named = 0

    def payloads(self, worker: WorkerKey | None, payloads: Sequence[pb.Payload]) -> Sequence[pb.Payload]:
        """``payloads`` for ``worker``, each storage set it keeps named by its id alone."""
        if not self._enabled:
            return payloads
        kept = self._kept.get(worker) if worker is not None else None
        out: list[pb.Payload] | None = None
        for i, p in enumerate(payloads):
            if p.WhichOneof("handle") != "cuda_ipc":
                continue
            set_id = p.cuda_ipc.storage_set_id
            if not set_id or not p.cuda_ipc.storages:
                continue
            known = self._known.get(set_id)
            if known is None:
                if len(self._known) >= self._MAX_KNOWN:
                    self._known.clear()
                    self._kept.clear()  # their names are gone with them
                    kept = None
                ref = pb.Payload(size_bytes=p.size_bytes, cuda_ipc=pb.CudaIpcHandle(storage_set_id=set_id))
                ref.device.CopyFrom(p.device)
                known = (p.cuda_ipc.storages_complete, ref)
                self._known[set_id] = known
            if kept is not None and set_id in kept:
                kept.move_to_end(set_id)
                if out is None:
                    out = list(payloads)
                out[i] = known[1]
                self.payloads_named += 1
        return payloads if out is None else out

    def kept(self, worker: WorkerKey, set_id: bytes) -> None:
        """``worker`` acked that it keeps the storage set named ``set_id``."""
        known = self._known.get(set_id)
        if known is None or not self._enabled:
            return
        kept = self._kept.setdefault(worker, collections.OrderedDict())
        if known[0]:
            # It was sent complete: the worker dropped every other set.
            kept.clear()
        kept[set_id] = None
        kept.move_to_end(set_id)
        while len(kept) > MAX_KEPT_STORAGE_SETS:
            kept.popitem(last=False)

    def forget(self, address: str) -> None:
        """Name nothing the worker at ``address`` kept (it failed an update: it may have restarted
        or let the sets go)."""
        for worker in [w for w in self._kept if w[0] == address]:
            del self._kept[worker]
