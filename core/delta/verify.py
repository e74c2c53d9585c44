"""The worker's two checks of a delta update: before anything is written, and before it commits.

``check_base`` runs at the header: a delta is only meaningful against the version it was computed
from, so a worker whose version differs, or whose weights are mixed after a failed update, refuses
with ``DELTA_BASE_MISMATCH`` and the trainer sends the update whole instead. ``verify_result``
runs after a target was written: it compares the checksum of every part the worker keeps with the
trainer's, so a worker that did not hold exactly the base (whatever the version says) is caught
with ``DELTA_RESULT_MISMATCH`` instead of serving drifted weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from weightwire.core.delta.checksums import checksum
from weightwire.core.delta.errors import (
    DELTA_BASE_MISMATCH,
    DELTA_RESULT_MISMATCH,
    delta_error,
    invalid_delta,
)
from weightwire.v1 import weight_transfer_pb2 as pb

Piece = tuple[int, int, int]  # (dim, offset, length) of a checkpoint tensor, as TensorPiece


def check_base(base_version: int, worker_version: int, *, consistent: bool) -> None:
    """Raise ``DELTA_BASE_MISMATCH`` unless the worker holds exactly ``base_version``."""
    if not consistent:
        raise delta_error(
            DELTA_BASE_MISMATCH,
            f"a delta against version {base_version} reached a worker whose weights are mixed after a "
            f"failed update (version {worker_version}); send the update whole",
            base_version=str(base_version),
            worker_version=str(worker_version),
        )
    if base_version != worker_version:
        raise delta_error(
            DELTA_BASE_MISMATCH,
            f"a delta against version {base_version} reached a worker at version {worker_version}; "
            "send the update whole",
            base_version=str(base_version),
            worker_version=str(worker_version),
        )


def piece_of(msg: pb.DeltaChecksum) -> Piece | None:
    return (msg.piece.dim, msg.piece.offset, msg.piece.length) if msg.HasField("piece") else None


def verify_result(
    checksums: Sequence[pb.DeltaChecksum],
    kept: Sequence[tuple[Piece | None, torch.Tensor]],
    **where: str,
) -> int:
    """Check each part the worker keeps against the trainer's checksum of it; the count verified.

    ``kept`` lists (piece, the worker's view of that piece after applying); piece None is the whole
    target. A part without a checksum is
    ``INVALID_DELTA`` (the trainer must cover every recipient's parts); a differing value is
    ``DELTA_RESULT_MISMATCH``.
    """
    label = ", ".join(f"{k} {v}" for k, v in where.items()) or "target"
    by_piece: dict[Piece | None, pb.Checksum] = {}
    for msg in checksums:
        if msg.checksum.algorithm == pb.CHECKSUM_ALGORITHM_UNSPECIFIED:
            raise invalid_delta(f"{label}: a result checksum without an algorithm", **where)
        by_piece[piece_of(msg)] = msg.checksum
    for piece, view in kept:
        want = by_piece.get(piece)
        if want is None:
            raise invalid_delta(
                f"{label}: no result checksum for the part {piece or 'whole'} this worker keeps", **where
            )
        try:
            got = checksum(view, want.algorithm)
        except ValueError as err:
            raise invalid_delta(f"{label}: {err}", **where) from None
        if got != want.value:
            raise delta_error(
                DELTA_RESULT_MISMATCH,
                f"{label}: after applying the delta, part {piece or 'whole'} has checksum {got}, the trainer's "
                f"is {want.value}: this worker did not hold the base; it needs a whole update",
                **where,
                expected=str(want.value),
                actual=str(got),
            )
    return len(kept)
