"""Pieces both sides of weightwire share, with no gRPC in them.

``dtypes`` (contract dtype <-> torch), ``devices`` (device identity and UUID normalisation),
``errors`` (the one exception type and the reason -> status-code table), ``shm`` (shared-memory
naming rules), ``manifest`` (shard manifests as Python values, fingerprints) and ``topology``
(pure tensor/pipeline ownership rules). Used by ``weightwire.server``, ``weightwire.client`` and
the adapters.
"""
