"""Prism engine: the cache wing (see docs/ARCHITECTURE.md)."""
