"""``PusherSeam``: what a push made by several trainer ranks together uses of its ``WeightPusher``.

The pusher's ``RankedPushDriver`` (``weightwire.client.push.ranked_driver``) implements it and hands it to
``collective_push``, so that the ranks' driver sits below the pusher and imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from weightwire.client.inputs.types import PushResult
    from weightwire.client.transports import exporter as exp
    from weightwire.client.update.jobs import Jobs
    from weightwire.client.update.options import PushOptions
    from weightwire.client.update.session import CommitGate
    from weightwire.client.update.setup import PushSetup
    from weightwire.client.update.staging import StagingPool


class PusherSeam(Protocol):
    """``prepare`` reads the manifests, picks the exporter for ``source`` and re-checks the workers
    before the ranks agree (a restarted worker fails every rank before a byte moves); ``run`` runs
    this rank's share of the update on the workers it streams to, with the ranks' commit gate."""

    @property
    def endpoints(self) -> Sequence[str]: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def pipeline_depth(self) -> int: ...

    @property
    def bucket_size_bytes(self) -> int: ...

    @property
    def align_bytes(self) -> int: ...

    @property
    def fingerprints(self) -> Mapping[str, str]: ...

    def prepare(self, source: torch.device, options: PushOptions) -> tuple[PushSetup, exp.Exporter]: ...

    def staging_pool(self, exporter: exp.Exporter, bucket_bytes: int) -> StagingPool: ...

    def run(
        self,
        setup: PushSetup,
        workers: Sequence[str],
        jobs: Jobs,
        options: PushOptions,
        commit_gate: CommitGate,
    ) -> dict[str, PushResult]: ...
