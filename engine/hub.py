"""Shim: ``engine.hub`` keeps working; the code is :mod:`engine.model.hub`."""

from .model.hub import CHECKPOINT_PATTERNS, resolve_checkpoint

__all__ = ["CHECKPOINT_PATTERNS", "resolve_checkpoint"]
