"""Adapter for any torch.nn.Module."""
