"""Attention decode geometry."""
