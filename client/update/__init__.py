"""One update's lifecycle on the trainer: its jobs and their routing, staging, the session that
streams and commits (``session``), and blame. Below ``ranks`` (which runs it on several ranks) and
``push`` (the ``WeightPusher`` that starts it)."""
