"""Delta updates: send only the elements that changed since a version the workers hold.

What both sides share (nothing here imports grpc): the encodings of a tensor's changes by density
and their in-place, bounds-checked application (``encoding``, over the ``Delta`` record of
``record`` and the torch kernels of ``torch_ops``), their layout in a payload and the contract's
``TensorDelta`` (``wire``), the checksums a worker verifies the result with (``checksums``), the
worker's checks of the base and the result (``verify``), and the trainer's record of what it last
sent (``base_keeper``, with its one pass per host tensor in ``host_pass``). docs/deltas.md
describes the design.
"""

from weightwire.core.delta.base_keeper import BaseKeeper, KeeperMemory
from weightwire.core.delta.checksums import (
    VERIFIED_ALGORITHMS,
    checksum,
    crc32,
    crc32c,
    crc_algorithm,
    preferred_algorithm,
    weighted_sum64,
    weighted_sum64_update,
)
from weightwire.core.delta.encoding import (
    Delta,
    Encoding,
    apply_delta,
    check_delta,
    choose_encoding,
    encode,
    encoded_size_bytes,
)
from weightwire.core.delta.errors import DELTA_BASE_MISMATCH, DELTA_RESULT_MISMATCH, INVALID_DELTA
from weightwire.core.delta.verify import check_base, verify_result
from weightwire.core.delta.wire import pack_delta, packed_size_bytes, read_delta

__all__ = [
    "DELTA_BASE_MISMATCH",
    "DELTA_RESULT_MISMATCH",
    "INVALID_DELTA",
    "VERIFIED_ALGORITHMS",
    "BaseKeeper",
    "Delta",
    "Encoding",
    "KeeperMemory",
    "apply_delta",
    "check_base",
    "check_delta",
    "checksum",
    "choose_encoding",
    "crc32",
    "crc32c",
    "crc_algorithm",
    "encode",
    "encoded_size_bytes",
    "pack_delta",
    "packed_size_bytes",
    "preferred_algorithm",
    "read_delta",
    "verify_result",
    "weighted_sum64",
    "weighted_sum64_update",
]
