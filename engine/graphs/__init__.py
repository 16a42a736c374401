"""Prism engine: the graphs wing (see docs/ARCHITECTURE.md)."""
