"""Dense decode task types (ids 16-63)."""
