"""Trainer-side client and CLI.

``WeightPusher`` pushes weights into engine workers (``push``, ``push_flat``, ``push_gathered``);
``PushError`` (from ``weightwire.core.errors``) names every worker that failed; ``PlanError`` is
raised before anything is sent; ``RankLostError`` when a trainer rank of a multi-rank (FSDP2) push
died or did not take part. The ``weightwire`` command line lives in ``cli`` and ``commands``.
"""

from weightwire.client.push.plan import PlanError, TensorSpec, layout_flat, pack_into, strip_wrapper_prefixes
from weightwire.client.push.pusher import FlatBucket, GatheredBucket, PushProgress, PushResult, WeightPusher
from weightwire.client.ranks.dtensor_gather import RankLostError
from weightwire.core.errors import PushError, WeightwireError

__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "PlanError",
    "PushError",
    "PushProgress",
    "PushResult",
    "RankLostError",
    "TensorSpec",
    "WeightPusher",
    "WeightwireError",
    "layout_flat",
    "pack_into",
    "strip_wrapper_prefixes",
]
