"""Prism engine: the model wing (see docs/ARCHITECTURE.md)."""
