"""Checkpoint logic: flattening, snapshots, commit, restore, verify, containers."""
