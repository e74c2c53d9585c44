"""Trainer-side client and CLI."""
