"""weightwire inside RL frameworks: optional glue, imported only by a user who asks for it.

``weightwire.integrations.trl`` is a weight-transfer backend for TRL's ``AsyncGRPOTrainer``
(``pip install "weightwire[trl]"``); ``weightwire.integrations.verl`` registers the ``weightwire``
checkpoint engine in verl (``pip install "weightwire[verl]"``). Nothing in ``weightwire.client``,
``weightwire.server`` or the adapters imports this package, so an engine's or a trainer's
environment without TRL or verl never loads them (docs/integrations.md).
"""
