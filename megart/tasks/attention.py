"""Attention decode task types (ids 64-95)."""
