"""Trainer-side client and CLI.

``WeightPusher`` pushes weights into engine workers (``push``, ``push_flat``, ``push_gathered``);
``PushError`` (from ``weightwire.core.errors``) names every worker that failed; ``PlanError`` is
raised before anything is sent; ``RankLostError`` when a trainer rank of a multi-rank (FSDP2) push
died or did not take part. ``TransferGroupOptions`` sends over a transfer group between machines;
``TrainerMetrics`` (Prometheus) and ``PushProgressBar`` (a terminal progress bar) observe pushes.
``ParallelRank`` describes a worker's ranks (what the demo model and ``serve`` take). Every name is
imported on first use. The ``weightwire`` command line lives in ``weightwire.client.cli``.
"""

from typing import TYPE_CHECKING, Any

__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "ParallelRank",
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
    from weightwire.client.inputs.dtensor_gather import RankLostError
    from weightwire.client.inputs.plan import (
        PlanError,
        TensorSpec,
        layout_flat,
        pack_into,
        strip_wrapper_prefixes,
    )
    from weightwire.client.observe.trainer_metrics import TrainerMetrics
    from weightwire.client.push.pusher import (
        FlatBucket,
        GatheredBucket,
        PushProgress,
        PushResult,
        WeightPusher,
    )
    from weightwire.client.transports.transfer_group import TransferGroupOptions
    from weightwire.core.errors import PushError, WeightwireError
    from weightwire.core.manifest import ParallelRank

# Every name is imported on first use: the pusher pulls in torch (seconds), and the ``weightwire``
# command line lives in this package, so an eager import here would make ``weightwire --version``,
# ``status`` and ``manifest`` wait for torch. A trainer that never asks for the progress bar or the
# metrics does not load rich or prometheus_client either.
_LAZY = {
    "FlatBucket": "weightwire.client.push.pusher",
    "GatheredBucket": "weightwire.client.push.pusher",
    "ParallelRank": "weightwire.core.manifest",
    "PlanError": "weightwire.client.inputs.plan",
    "PushError": "weightwire.core.errors",
    "PushProgress": "weightwire.client.push.pusher",
    "PushProgressBar": "weightwire.client.cli.progress",
    "PushResult": "weightwire.client.push.pusher",
    "RankLostError": "weightwire.client.inputs.dtensor_gather",
    "TensorSpec": "weightwire.client.inputs.plan",
    "TrainerMetrics": "weightwire.client.observe.trainer_metrics",
    "TransferGroupOptions": "weightwire.client.transports.transfer_group",
    "WeightPusher": "weightwire.client.push.pusher",
    "WeightwireError": "weightwire.core.errors",
    "layout_flat": "weightwire.client.inputs.plan",
    "pack_into": "weightwire.client.inputs.plan",
    "strip_wrapper_prefixes": "weightwire.client.inputs.plan",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
