"""``RankedPushDriver``: the ``PusherSeam`` (``weightwire.client.ranks.pusher_seam``) that a push of
several trainer ranks (``weightwire.client.ranks.collective_push``) drives its pusher through.

``WeightPusher.push`` makes one over itself (an ``UpdateRunner``,
``weightwire.client.push.update_runner``) for a multi-rank push that gathers through one rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from weightwire.client.inputs.types import PushResult
from weightwire.client.push.update_runner import UpdateRunner
from weightwire.client.transports import exporter as exp
from weightwire.client.update import jobs as job_builders
from weightwire.client.update.options import PushOptions
from weightwire.client.update.session import CommitGate
from weightwire.client.update.setup import PushSetup
from weightwire.client.update.staging import StagingPool


class RankedPushDriver:
    """What a push made by several trainer ranks together (``weightwire.client.ranks.collective_push``)
    uses of its ``WeightPusher``: the seam between one rank's lifecycle of an update and the ranks'
    lockstep, so that the multi-rank driver reaches no private member of the pusher.

    ``prepare`` reads the manifests, picks the exporter for ``source`` and re-checks the workers
    before the ranks agree (a restarted worker fails every rank before a byte moves); ``run`` runs
    this rank's share of the update on the workers it streams to, with the ranks' commit gate.
    """

    def __init__(self, pusher: UpdateRunner) -> None:
        self._pusher = pusher
        self.endpoints: Sequence[str] = pusher.endpoints
        self.timeout_s = pusher.timeout_s
        self.pipeline_depth = pusher.pipeline_depth
        self.bucket_size_bytes = pusher.bucket_size_bytes
        self.align_bytes = pusher.align_bytes

    def prepare(self, source: torch.device, options: PushOptions) -> tuple[PushSetup, exp.Exporter]:
        pusher = self._pusher
        setup, exporter = pusher._setup_exporting(source, dataclasses.replace(options, only_own_device=False))
        if pusher.recheck_manifests:
            pusher._recheck(setup.manifests, setup.recheck)
        setup.recheck = None
        setup.rechecked = True
        return setup, exporter

    @property
    def fingerprints(self) -> Mapping[str, str]:
        """The workers' manifest fingerprints the update was planned against."""
        return dict(self._pusher._fingerprints)

    def staging_pool(self, exporter: exp.Exporter, bucket_bytes: int) -> StagingPool:
        return self._pusher._staging.pool(exporter, bucket_bytes)

    def run(
        self,
        setup: PushSetup,
        workers: Sequence[str],
        jobs: job_builders.Jobs,
        options: PushOptions,
        commit_gate: CommitGate,
    ) -> dict[str, PushResult]:
        """This rank's streams to ``workers`` (a subset of ``setup``'s), committed only when
        ``commit_gate`` (every rank's agreement) lets them."""
        sub = dataclasses.replace(
            setup, manifests={a: setup.manifests[a] for a in workers}, recheck=None, rechecked=True
        )
        return self._pusher._run(sub, jobs, options, commit_gate=commit_gate)
