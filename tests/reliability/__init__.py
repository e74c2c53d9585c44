"""Reliability and security tests: real worker processes killed mid-update, hostile messages, load,
tokens and TLS. ``python -m tests.reliability.load`` runs the load test as a script."""
