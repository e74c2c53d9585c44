"""The generated ``weightwire.v1`` contract (``weight_transfer.proto``). Regenerate with ``make proto``."""
