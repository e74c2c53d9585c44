"""Trainer-side client and CLI.

``WeightPusher`` pushes weights into engine workers (``push``, ``push_flat``, ``push_gathered``);
``PushError`` (from ``weightwire.core.errors``) names every worker that failed; ``PlanError`` is
raised before anything is sent; ``RankLostError`` when a trainer rank of a multi-rank (FSDP2) push
died or did not take part. ``TransferGroupOptions`` sends over a transfer group between machines;
``TrainerMetrics`` (Prometheus) and ``PushProgressBar`` (a terminal progress bar) observe pushes and
are imported on first use. The ``weightwire`` command line lives in ``weightwire.client.cli``.
"""

from typing import TYPE_CHECKING, Any

from weightwire.client.push.plan import PlanError, TensorSpec, layout_flat, pack_into, strip_wrapper_prefixes
from weightwire.client.push.pusher import FlatBucket, GatheredBucket, PushProgress, PushResult, WeightPusher
from weightwire.client.ranks.dtensor_gather import RankLostError
from weightwire.client.transports.transfer_group import TransferGroupOptions
from weightwire.core.errors import PushError, WeightwireError

__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "PlanError",
    "PushError",
    "PushProgress",
    "PushProgressBar",
    "PushResult",
    "RankLostError",
    "TensorSpec",
    "TrainerMetrics",
    "TransferGroupOptions",
    "WeightPusher",
    "WeightwireError",
    "layout_flat",
    "pack_into",
    "strip_wrapper_prefixes",
]

if TYPE_CHECKING:
    from weightwire.client.cli.progress import PushProgressBar
    from weightwire.client.observe.trainer_metrics import TrainerMetrics

_LAZY = {
    "PushProgressBar": "weightwire.client.cli.progress",
    "TrainerMetrics": "weightwire.client.observe.trainer_metrics",
}


def __getattr__(name: str) -> Any:
    # Imported on first use: a trainer that never asks for them does not load rich or prometheus_client.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
