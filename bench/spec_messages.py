"""CPU cost of a bucket's tensor specs on each side, sent whole or named by ``layout_id``.

The control work ``Bucket.layout_id`` takes out of a repeated push, measured on the real messages
of one model (default ``qwen3-8b-names``: Qwen3-8B's 399 tensors), in one process, best of five
rounds of ``--number`` calls each: the trainer's bucket request built from its spec template and
serialized (``SpecTemplates.request``, the same code every transport uses); the worker's parse and
the lookup of its checked layout (by the message's serialized bytes when the specs are sent, by id
when they are named). gRPC's own handling of the bytes is not in it::

    python bench/spec_messages.py [--model qwen3-8b-names] [--number 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from rig import flat_buckets, make_rig
from weightwire.client.update.session import SpecTemplates
from weightwire.server.rules.layout import LayoutCache, payload_signature
from weightwire.v1 import weight_transfer_pb2 as pb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b-names")
    p.add_argument("--number", type=int, default=2000)
    args = p.parse_args(argv)
    rig = make_rig(args.model, torch.device("cpu"), peer=False)
    specs = flat_buckets(rig.flat, rig.specs, None)[0].specs
    payload = pb.Payload(size_bytes=rig.size, host_shm=pb.HostShmHandle(name="ww-bench"))
    templates = SpecTemplates(layout_ids=True)
    worker = ("worker", "fingerprint", "instance")
    first = templates.request(specs, 0, pb.PushWeightsRequest(), worker)
    templates.kept(worker, first.bucket.layout_id)

    def trainer(named: bool) -> bytes:
        request = templates.request(specs, 0, pb.PushWeightsRequest(), worker if named else None)
        request.bucket.payloads.append(payload)
        return request.SerializeToString()

    whole, named = trainer(False), trainer(True)
    cache = LayoutCache()

    def worker_whole() -> object:
        msg = pb.PushWeightsRequest.FromString(whole).bucket
        return cache.get_message(msg.SerializeToString(), "fingerprint")

    def worker_named() -> object:
        msg = pb.PushWeightsRequest.FromString(named).bucket
        return cache.by_ref(msg.layout_id, "fingerprint"), payload_signature(list(msg.payloads))

    def best_us(fn: object) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=5)) / args.number * 1e6  # type: ignore[arg-type]

    print(f"{args.model}: {len(specs)} specs; bucket request {len(whole)} bytes whole, {len(named)} named")
    print(
        f"trainer (build + serialize): whole {best_us(lambda: trainer(False)):.1f} us, "
        f"named {best_us(lambda: trainer(True)):.1f} us"
    )
    print(
        f"worker (parse + layout lookup): whole {best_us(worker_whole):.1f} us, named {best_us(worker_named):.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
