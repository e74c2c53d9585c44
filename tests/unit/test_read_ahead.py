"""read_ahead: an importer that declares ``ReadsAhead`` is told of every bucket as soon as it is read,
in stream order, while the messages still reach the caller one at a time; a stream without such an
importer is passed through untouched."""

from __future__ import annotations

import threading

from weightwire.server.transports.read_ahead import ReadsAhead, read_ahead
from weightwire.v1 import weight_transfer_pb2 as pb


class _Announced:
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.threads: set[str] = set()

    def ahead(self, payload: pb.Payload) -> None:
        self.seen.append(payload.size_bytes)
        self.threads.add(threading.current_thread().name)


class _Plain:
    """An importer without ``ahead``."""


def _bucket(i: int, field: str) -> pb.PushWeightsRequest:
    payload = pb.Payload(size_bytes=i)
    if field == "inline":
        payload.inline_data = b"x"
    else:
        payload.host_shm.name = "ww-x"
    return pb.PushWeightsRequest(bucket=pb.Bucket(index=i, payloads=[payload]))


def _stream(field: str) -> list[pb.PushWeightsRequest]:
    return [
        pb.PushWeightsRequest(header=pb.UpdateHeader(version=1)),
        *(_bucket(i, field) for i in range(5)),
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=5)),
    ]


def test_an_importer_that_reads_ahead_sees_every_bucket_in_order() -> None:
    announced = _Announced()
    assert isinstance(announced, ReadsAhead) and not isinstance(_Plain(), ReadsAhead)
    got = list(read_ahead(iter(_stream("host_shm")), {"host_shm": announced}))
    assert [r.WhichOneof("message") for r in got] == ["header", *["bucket"] * 5, "commit"]
    assert [r.bucket.index for r in got if r.HasField("bucket")] == list(range(5))
    assert announced.seen == list(range(5))
    assert "ww-read-ahead" in announced.threads  # the later buckets were announced by the reading thread


def test_a_stream_without_such_an_importer_is_passed_through() -> None:
    stream = _stream("inline")
    assert list(read_ahead(iter(stream), {"inline": _Plain()})) == stream
