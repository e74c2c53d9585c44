"""weightwire: move fresh model weights from an RL trainer into running inference-engine workers.

Sub-packages: ``weightwire.v1`` (the generated protobuf contract), ``weightwire.core`` (pieces both
sides share: dtypes, device identity, error reasons, shared-memory naming), ``weightwire.server``
(the engine-side worker service), ``weightwire.client`` (the trainer-side pusher and the CLI) and
``weightwire.adapters`` (engine glue: plain torch, SGLang).
"""

__version__ = "0.1.0"
