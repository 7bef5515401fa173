"""Checkpoints: layout, manifest, atomic checksummed writes, rotation, find / verify / load."""

from .store import CheckpointError, get_last_checkpoint, load_weights, verify_checkpoint

__all__ = ["CheckpointError", "get_last_checkpoint", "load_weights", "verify_checkpoint"]
