"""Prism app package."""
