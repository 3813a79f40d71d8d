"""Checkpoints and exports."""
