"""Prism engine: the inputs wing (see docs/ARCHITECTURE.md)."""
