"""Engine glue. ``weightwire.adapters.torch`` serves any ``torch.nn.Module`` (demo, tests);
``weightwire.adapters.sglang`` runs a worker service inside every SGLang scheduler process."""
