"""Checkpoints: completion markers and digests, saving and loading, resuming on another layout, export."""
