"""``WeightPusher`` (``pusher``): the trainer's entry point, which plans a push and hands it to one
update (``weightwire.client.update``) or to the ranks (``weightwire.client.ranks``). The top layer
of the client below the command line. Its base, ``UpdateRunner`` (``update_runner``), holds the
workers and runs one update; ``ranked_driver`` is the seam the multi-rank push drives it through.

``plan`` and ``jobs`` here are the modules of ``weightwire.client.inputs.plan`` and
``weightwire.client.update.jobs`` under the paths they had before the client was layered.
"""
