"""Prism engine: the serving wing (see docs/ARCHITECTURE.md)."""
