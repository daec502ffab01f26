"""Lightning adapter (issue 3)."""
