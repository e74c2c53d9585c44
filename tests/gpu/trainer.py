"""A trainer process for the GPU suite: runs weightwire's client on its GPU and obeys line commands.

Started by tests/gpu/test_colocated.py with CUDA_VISIBLE_DEVICES set to the trainer's GPU (it uses
its ``cuda:0``). Each command on stdin gets one JSON line on stdout. Weights of version ``v`` are
``full_checkpoint(DemoConfig(), seed=v)``. Handles travel between trainer processes as the hex of a
serialised ``weightwire.v1.Payload`` (never pickle).

  push V OPTS       WeightPusher.push of version V from this GPU (OPTS: JSON, see Trainer.push); the
                    parameters stay where they are between pushes, as a training loop's do
  replace V         swap one parameter for a new allocation (the old one freed), push V, and answer
                    the GPU memory this process holds before and after (see Trainer.replace)
  flat V OPTS       WeightPusher.push_flat of a GPU buffer exported in place (see Trainer.push_flat_buffer)
  prepare V         pack version V into this process's flat GPU buffer; answer its payload
  gathered V OPTS   WeightPusher.push_gathered: this GPU's flat buffer plus payloads of other ranks
  raw V OPTS        one hand-built PushWeights stream to one worker (to read every BucketAck)
  status            every worker's GetStatus
  quit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import grpc
import torch
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client.inputs.plan import layout_flat, pack_into
from weightwire.client.push.pusher import FlatBucket, GatheredBucket, WeightPusher
from weightwire.client.rpc.calls import Worker, error_from_rpc
from weightwire.client.transports.cuda_ipc import CudaIpcExporter
from weightwire.core.errors import PushError, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

DEVICE = torch.device("cuda", 0)
CONFIG = DemoConfig()


def error_json(err: WeightwireError) -> dict[str, str]:
    return {"reason": err.reason, "code": err.code, "message": err.message}


class Trainer:
    def __init__(self, endpoints: list[str], bucket_size_bytes: int) -> None:
        self.endpoints = endpoints
        self.pusher = WeightPusher(
            endpoints, transport="cuda_ipc", bucket_size_bytes=bucket_size_bytes, timeout_s=120
        )
        self.exporter = CudaIpcExporter(DEVICE)
        self.flat: torch.Tensor | None = None
        self.lead_buffer: torch.Tensor | None = None
        self.params: dict[str, torch.Tensor] = {}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version`` written into the same GPU tensors every time (the step's writes,
        queued on the current stream right before the push)."""
        fresh = {name: t.to(DEVICE) for name, t in full_checkpoint(CONFIG, version).items()}
        if not self.params:
            self.params = fresh
        else:
            for name, t in fresh.items():
                self.params[name].copy_(t)
        return dict(self.params)

    def storages_shared(self) -> int:
        # Test-only look into the pusher: how many storages it exported where they live.
        return sum(getattr(e, "storages_shared", 0) for e in self.pusher._staging._exporters.values())

    def storage_sets_named(self) -> int:
        # Test-only look into the pusher: payloads sent as the name of a storage set the worker keeps.
        return self.pusher._templates.storage_sets.payloads_named

    def replace(self, version: int) -> dict[str, Any]:
        """One parameter becomes a new allocation and the old one is freed (an optimizer that swaps
        tensors), then version ``version`` is pushed. The old allocation may stay reserved only while
        a worker maps it: after the push (whose complete payload no longer lists it) and
        ``ipc_collect``, this process holds what it held before."""
        self.weights(version)
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        before = torch.cuda.memory_allocated(DEVICE)
        name = max(self.params, key=lambda n: self.params[n].numel())
        self.params[name] = self.params[name].clone()
        torch.cuda.synchronize()
        answer = self._pushed(lambda: self.pusher.push(dict(self.params), version=version))
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        answer["allocated_before"] = before
        answer["allocated_after"] = torch.cuda.memory_allocated(DEVICE)
        answer["storages_shared"] = self.storages_shared()
        answer["storage_sets_named"] = self.storage_sets_named()
        return answer

    def _pushed(self, call: Any) -> dict[str, Any]:
        try:
            results = call()
        except PushError as e:
            return {
                "ok": False,
                "failures": {a: error_json(err) for a, err in e.failures.items()},
                "results": {a: dataclasses.asdict(r) for a, r in e.results.items()},  # type: ignore[call-overload]
            }
        except WeightwireError as e:  # a plan error: nothing was sent
            return {"ok": False, "plan_error": error_json(e)}
        return {"ok": True, "results": {a: dataclasses.asdict(r) for a, r in results.items()}}

    def push(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        tensors = self.weights(version)
        answer = self._pushed(
            lambda: self.pusher.push(
                tensors,
                version=version,
                only_own_device=bool(opts.get("only_own_device")),
                verify_checksums=bool(opts.get("verify")),
            )
        )
        answer["storages_shared"] = self.storages_shared()
        answer["storage_sets_named"] = self.storage_sets_named()
        return answer

    def push_flat_buffer(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        """push_flat of one GPU buffer that starts ``opts['lead']`` bytes into its allocation (an
        all-gather output slice, say): exported in place, no packing copy."""
        items = list(self.weights(version).items())
        specs, size = layout_flat(items)
        lead = int(opts.get("lead", 0))
        if self.lead_buffer is None or self.lead_buffer.numel() != lead + size:
            self.lead_buffer = torch.empty(lead + size, dtype=torch.uint8, device=DEVICE)
        view = self.lead_buffer[lead:]
        pack_into(view, specs, [t for _, t in items])
        return self._pushed(
            lambda: self.pusher.push_flat(
                [FlatBucket(view, specs)], version=version, verify_checksums=bool(opts.get("verify"))
            )
        )

    def prepare(self, version: int) -> tuple[list[Any], int, pb.Payload]:
        """Pack version ``version`` into the persistent flat buffer; the same layout on every rank."""
        items = list(self.weights(version).items())
        specs, size = layout_flat(items)
        if self.flat is None or self.flat.numel() < size:
            self.flat = torch.empty(size, dtype=torch.uint8, device=DEVICE)
        pack_into(self.flat, specs, [t for _, t in items])
        buf = self.exporter.wrap(self.flat[:size])
        if buf is None:
            raise RuntimeError("the flat GPU buffer could not be exported in place")
        buf.ready()
        payload = self.exporter.export(buf, buf.base_offset_bytes + size, self.exporter.label)  # type: ignore[arg-type]
        return specs, size, payload

    def gathered(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        specs, size, mine = self.prepare(version)
        payloads: list[pb.Payload | torch.Tensor] = []
        if opts.get("local", True):
            if opts.get("label"):
                # The same handle, labelled as another tool prints this GPU's UUID.
                mine.device.uuid = opts["label"]
                payloads.append(mine)
            else:
                assert self.flat is not None
                payloads.append(self.flat[:size])
        payloads += [pb.Payload.FromString(bytes.fromhex(h)) for h in opts.get("remote", [])]
        bucket = GatheredBucket(specs=specs, payloads=payloads, size_bytes=size)
        return self._pushed(
            lambda: self.pusher.push_gathered(
                [bucket],
                version=version,
                allow_peer_device_import=bool(opts.get("allow_peer")),
                precheck_labels=bool(opts.get("precheck", True)),
                verify_checksums=bool(opts.get("verify")),
            )
        )

    def raw(self, version: int, opts: dict[str, Any]) -> dict[str, Any]:
        """One stream to ``opts['endpoint']`` with the given payloads; every ack is reported."""
        specs, _, mine = self.prepare(version)
        payloads = [pb.Payload.FromString(bytes.fromhex(h)) for h in opts.get("remote", [])]
        if opts.get("local", False):
            payloads.append(mine)
        manifest = self.pusher.manifests()[opts["endpoint"]]
        header = pb.UpdateHeader(
            version=version,
            scope=pb.UPDATE_SCOPE_FULL,
            manifest_fingerprint=manifest.fingerprint,
            allow_peer_device_import=bool(opts.get("allow_peer")),
        )
        bucket = pb.Bucket(index=0, tensors=[s.to_proto() for s in specs], payloads=payloads)
        requests = [
            pb.PushWeightsRequest(header=header),
            pb.PushWeightsRequest(bucket=bucket),
            pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
        ]
        worker = Worker(opts["endpoint"])
        acks: list[dict[str, Any]] = []
        try:
            for resp in worker.stub.PushWeights(iter(requests), timeout=120):
                if resp.HasField("ack"):
                    a = resp.ack
                    acks.append(
                        {
                            "source_uuid": a.source_device.uuid,
                            "peer_device_import": a.peer_device_import,
                            "handle_opened": a.handle_opened,
                            "tensors_loaded": a.tensors_loaded,
                            "transport": pb.TransportKind.Name(a.transport),
                        }
                    )
                else:
                    return {"ok": True, "acks": acks, "version": resp.result.version}
        except grpc.RpcError as e:
            return {
                "ok": False,
                "acks": acks,
                "error": error_json(error_from_rpc(e, worker=opts["endpoint"])),
            }
        finally:
            worker.close()
        return {"ok": False, "acks": acks, "error": {"reason": "NO_RESULT", "code": "", "message": ""}}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a, st in self.pusher.status().items():
            out[a] = {
                "version": st.weights_version,
                "state": pb.WorkerState.Name(st.state).removeprefix("WORKER_STATE_"),
                "open_mappings": st.open_mappings,
                "updates_failed": st.updates_failed,
                "last_error": st.last_error.reason if st.HasField("last_error") else "",
                "device_uuid": st.device.uuid,
            }
        return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--bucket-size-bytes", type=int, default=128 * 1024)
    args = parser.parse_args()
    trainer = Trainer(args.endpoints.split(","), args.bucket_size_bytes)

    def reply(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        for line in sys.stdin:
            cmd, *rest = line.strip().split(" ", 2)
            version = int(rest[0]) if rest else 0
            opts = json.loads(rest[1]) if len(rest) > 1 else {}
            if cmd == "push":
                reply(trainer.push(version, opts))
            elif cmd == "replace":
                reply(trainer.replace(version))
            elif cmd == "flat":
                reply(trainer.push_flat_buffer(version, opts))
            elif cmd == "prepare":
                reply({"payload": trainer.prepare(version)[2].SerializeToString().hex()})
            elif cmd == "gathered":
                reply(trainer.gathered(version, opts))
            elif cmd == "raw":
                reply(trainer.raw(version, opts))
            elif cmd == "status":
                reply(trainer.status())
            elif cmd == "uuid":
                reply({"uuid": trainer.exporter.label.uuid if trainer.exporter.label else ""})
            elif cmd == "quit":
                break
            else:
                reply({"error": f"unknown command {cmd!r}"})
    finally:
        trainer.pusher.close()
        trainer.exporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
