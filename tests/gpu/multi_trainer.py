"""One trainer rank of the multi-GPU scenarios (tests/gpu/test_multi_gpu.py): exports its own copy
of the weights from its GPU, and, on the rank that gathers, pushes gathered buckets to one or more
engines (one ``WeightPusher`` per engine, since an update is all-or-nothing across the endpoints of
one pusher while replicas commit or fail on their own).

Started by tests/gpu/multi_procs.py with CUDA_VISIBLE_DEVICES set to the rank's GPU (it uses its
``cuda:0``); with ``--sim-label`` (WEIGHTWIRE_GPU_SIM dry runs) it exports host shared memory labelled
as that simulated GPU instead. Each stdin line ``CMD V JSON`` gets one JSON line on stdout. Handles
travel between ranks as the hex of a serialised ``weightwire.v1.Payload`` (never pickle).

  prepare V {"seed": S}         pack the demo checkpoint of seed S (default V) into this rank's
                                flat buffer (same buffer every time); answer its payload
  manifests                     every engine worker's manifest (names, bytes, device)
  gathered V {"buckets": [[hex, ...], ...], "engines": [...], "precheck": bool}
                                push version V to the engines at once (a thread per engine); bucket j
                                holds the layout's tensors j, j+nb, ... and the payloads listed for it
  raw V {"endpoint": A, "buckets": ...}
                                the same update as one hand-built stream to one worker, answering
                                every BucketAck (source device, tensors loaded and skipped, timings)
  status                        every engine worker's GetStatus
  quit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from typing import Any

import grpc
import torch
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client.inputs.plan import TensorSpec, layout_flat, pack_into
from weightwire.client.push.pusher import GatheredBucket, WeightPusher
from weightwire.client.rpc.calls import Worker, error_from_rpc
from weightwire.client.transports.exporter import Exporter, HostShmExporter, StagingBuffer
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

CONFIG = DemoConfig()


def error_json(err: WeightwireError) -> dict[str, str]:
    return {"reason": err.reason, "code": err.code, "message": err.message}


def split_specs(specs: list[TensorSpec], nb: int) -> list[list[TensorSpec]]:
    """Bucket j holds the layout's tensors j, j+nb, j+2nb, ...: every bucket mixes tensors of every
    pipeline stage, so each worker must skip the other stages' tensors in each of them."""
    return [specs[j::nb] for j in range(nb)]


class Rank:
    def __init__(self, engines: dict[str, list[str]], sim_label: str | None, bucket_size_bytes: int) -> None:
        self.sim = sim_label is not None
        self.exporter: Exporter
        if sim_label is not None:
            self.device = torch.device("cpu")
            self.exporter = HostShmExporter()
            self.label = DeviceRef.host(sim_label)
        else:
            from weightwire.client.transports.cuda_ipc import CudaIpcExporter

            self.device = torch.device("cuda", 0)
            self.exporter = CudaIpcExporter(self.device)
            assert self.exporter.label is not None
            self.label = self.exporter.label
        self.specs, self.size = layout_flat(list(full_checkpoint(CONFIG, 0).items()))
        self.buffer: StagingBuffer | None = None
        self.flat: torch.Tensor | None = None
        transport = "host_shm" if self.sim else "cuda_ipc"
        self.pushers = {
            name: WeightPusher(eps, transport=transport, bucket_size_bytes=bucket_size_bytes, timeout_s=120)
            for name, eps in engines.items()
        }

    def prepare(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        seed = int(opts.get("seed", version))
        tensors = [t.to(self.device) for t in full_checkpoint(CONFIG, seed).values()]
        if self.buffer is None:
            if self.sim:
                self.buffer = self.exporter.allocate(self.size)
                self.flat = self.buffer.tensor()[: self.size]
            else:
                self.flat = torch.empty(self.size, dtype=torch.uint8, device=self.device)
                self.buffer = self.exporter.wrap(self.flat)
                if self.buffer is None or self.buffer.base_offset_bytes != 0:
                    raise RuntimeError(
                        "the flat GPU buffer could not be exported in place from its first byte"
                    )
        assert self.flat is not None
        pack_into(self.flat, self.specs, tensors)
        self.buffer.ready()
        payload = self.exporter.export(self.buffer, self.size, self.label)
        return {"payload": payload.SerializeToString().hex(), "uuid": self.label.uuid, "seed": seed}

    def _buckets(self, opts: dict[str, Any]) -> list[tuple[list[TensorSpec], list[pb.Payload]]]:
        lists = opts["buckets"]
        groups = split_specs(self.specs, len(lists))
        return [
            (group, [pb.Payload.FromString(bytes.fromhex(h)) for h in hexes])
            for group, hexes in zip(groups, lists, strict=True)
        ]

    def _by_endpoint(self) -> dict[str, WeightPusher]:
        return {a: p for p in self.pushers.values() for a in p.endpoints}

    def manifests(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for pusher in self.pushers.values():
            for a, m in pusher.manifests().items():
                out[a] = {
                    "worker_id": m.worker_id,
                    "device_uuid": m.device.uuid,
                    "names": sorted(m.tensors),
                    "total_bytes": m.total_bytes,
                    "layers": [m.layer_start, m.layer_end],
                }
        return out

    def gathered(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        buckets = [GatheredBucket(specs=s, payloads=p, size_bytes=self.size) for s, p in self._buckets(opts)]
        names = opts.get("engines") or list(self.pushers)
        answers: dict[str, Any] = {}

        def one(name: str) -> None:
            try:
                results = self.pushers[name].push_gathered(
                    buckets, version=version, precheck_labels=bool(opts.get("precheck", True))
                )
            except PushError as e:
                answers[name] = {
                    "ok": False,
                    "failures": {a: error_json(err) for a, err in e.failures.items()},
                    "results": {a: dataclasses.asdict(r) for a, r in e.results.items()},  # type: ignore[call-overload]
                }
            except WeightwireError as e:  # a plan error: nothing was sent
                answers[name] = {"ok": False, "plan_error": error_json(e)}
            else:
                answers[name] = {
                    "ok": True,
                    "results": {a: dataclasses.asdict(r) for a, r in results.items()},
                }

        threads = [threading.Thread(target=one, args=(n,), name=f"push-{n}") for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return answers

    def raw(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        endpoint = opts["endpoint"]
        manifest = self._by_endpoint()[endpoint].manifests()[endpoint]
        buckets = self._buckets(opts)
        requests = [
            pb.PushWeightsRequest(
                header=pb.UpdateHeader(
                    version=version,
                    scope=pb.UPDATE_SCOPE_FULL,
                    manifest_fingerprint=manifest.fingerprint,
                    update_id=f"raw-v{version}",
                )
            )
        ]
        for j, (specs, payloads) in enumerate(buckets):
            requests.append(
                pb.PushWeightsRequest(
                    bucket=pb.Bucket(index=j, tensors=[s.to_proto() for s in specs], payloads=payloads)
                )
            )
        requests.append(pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=len(buckets))))
        bucket_names = [[s.name for s in specs] for specs, _ in buckets]
        worker = Worker(endpoint)
        acks: list[dict[str, Any]] = []
        try:
            for resp in worker.stub.PushWeights(iter(requests), timeout=120):
                if resp.HasField("ack"):
                    a = resp.ack
                    acks.append(
                        {
                            "index": a.index,
                            "source_uuid": a.source_device.uuid,
                            "peer_device_import": a.peer_device_import,
                            "handle_opened": a.handle_opened,
                            "tensors_loaded": a.tensors_loaded,
                            "tensors_skipped": a.tensors_skipped,
                            "bytes_loaded": a.bytes_loaded,
                            "transport": pb.TransportKind.Name(a.transport),
                            "open_duration_ns": a.open_duration_ns,
                            "load_duration_ns": a.load_duration_ns,
                        }
                    )
                else:
                    r = resp.result
                    result = {
                        "version": r.version,
                        "bytes_loaded": r.bytes_loaded,
                        "tensors_loaded": r.tensors_loaded,
                        "handles_opened": r.handles_opened,
                        "duration_ns": r.duration_ns,
                    }
                    return {"ok": True, "acks": acks, "result": result, "bucket_names": bucket_names}
        except grpc.RpcError as e:
            return {"ok": False, "acks": acks, "error": error_json(error_from_rpc(e, worker=endpoint))}
        finally:
            worker.close()
        return {"ok": False, "acks": acks, "error": {"reason": "NO_RESULT", "code": "", "message": ""}}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for pusher in self.pushers.values():
            for a, st in pusher.status().items():
                out[a] = {
                    "version": st.weights_version,
                    "state": pb.WorkerState.Name(st.state).removeprefix("WORKER_STATE_"),
                    "open_mappings": st.open_mappings,
                    "updates_failed": st.updates_failed,
                    "last_error": st.last_error.reason if st.HasField("last_error") else "",
                    "device_uuid": st.device.uuid,
                    "worker_id": st.worker_id,
                }
        return out

    def close(self) -> None:
        for p in self.pushers.values():
            p.close()
        self.flat = None
        if self.buffer is not None:
            self.buffer.close()
        self.exporter.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--engine", action="append", default=[], metavar="NAME=ADDR,ADDR", help="an engine to push to"
    )
    parser.add_argument("--sim-label", default=None, help="simulated GPU UUID (host shared memory, no CUDA)")
    parser.add_argument("--bucket-size-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    engines = {}
    for item in args.engine:
        name, _, eps = item.partition("=")
        engines[name] = [e for e in eps.split(",") if e]
    rank = Rank(engines, args.sim_label, args.bucket_size_bytes)

    def reply(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        for line in sys.stdin:
            cmd, *rest = line.strip().split(" ", 2)
            version = int(rest[0]) if rest else 0
            opts = json.loads(rest[1]) if len(rest) > 1 else {}
            if cmd == "prepare":
                reply(rank.prepare(version, opts))
            elif cmd == "manifests":
                reply(rank.manifests())
            elif cmd == "gathered":
                reply(rank.gathered(version, opts))
            elif cmd == "raw":
                reply(rank.raw(version, opts))
            elif cmd == "status":
                reply(rank.status())
            elif cmd == "quit":
                break
            else:
                reply({"error": f"unknown command {cmd!r}"})
    finally:
        rank.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
