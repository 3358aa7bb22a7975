"""Reclaiming storage: checkpoint watermarks and garbage collection."""
