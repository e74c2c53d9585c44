"""Engine-side worker service."""
