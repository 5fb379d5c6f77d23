"""Shared machinery for the training recipes: data, checkpoints, tracking, health."""
