"""Plain-text tables and numbers of the ``weightwire`` commands (``commands``, ``demo``, the fleet view).

A module of its own so that those three share them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_MB = 1024 * 1024


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()
) -> str:
    """A plain-text table with a header rule; columns in ``right`` are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def short_device(kind: int, uuid: str) -> str:
    from weightwire.v1 import weight_transfer_pb2 as pb

    name = {pb.DEVICE_KIND_CUDA: "cuda", pb.DEVICE_KIND_HOST: "host"}.get(kind, "?")
    return f"{name}:{uuid[:8]}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# Below this many bytes a worker's update time is mostly per-call latency (planning, the streams'
# round trips, the commit), so bytes / time says nothing about the link: the rate is left out.
MIN_RATE_BYTES = 8 * _MB
LATENCY_NOTE = (
    f"GB/s: for shards of {MIN_RATE_BYTES // _MB} MiB or more; a smaller update is latency-bound (see ms)"
)


def rate(nbytes: int, gbps: float) -> str:
    """A worker's GB/s for a table, or "-" where its update was too small to measure a rate."""
    return f"{gbps:.2f}" if nbytes >= MIN_RATE_BYTES else "-"


def results_table(results: Mapping[str, Any], manifests: Mapping[str, Any] | None = None) -> str:
    rows = []
    for addr, r in results.items():
        owned = len(manifests[addr].tensors) if manifests else "-"
        rows.append(
            (
                r.worker_id or addr,
                r.version,
                owned,
                r.tensors_loaded,
                r.buckets,
                r.handles_opened,
                human_bytes(r.bytes_loaded),
                f"{r.duration_s * 1e3:.1f}",
                rate(r.bytes_loaded, r.gbps),
                r.transport,
            )
        )
    table = format_table(
        ("worker", "version", "owned", "loaded", "buckets", "handles", "bytes", "ms", "GB/s", "transport"),
        rows,
        right=(1, 2, 3, 4, 5, 6, 7, 8),
    )
    return table + ("\n" + LATENCY_NOTE if any(row[8] == "-" for row in rows) else "")
