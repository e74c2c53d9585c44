"""The client's gRPC: channels, call metadata and errors from a failed call (``calls``), and one
worker's update stream (``stream``). Imports nothing of ``weightwire.client`` but ``inputs``."""
