"""Prism ops package."""
