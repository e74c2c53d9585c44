"""Pushes made by several trainer ranks together (FSDP2 / DTensor): gathering, agreeing on one update, and the collective push."""
