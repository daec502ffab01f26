"""Accelerate adapter (issue 4)."""
