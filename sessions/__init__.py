"""Prism sessions package."""
