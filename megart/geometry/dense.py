"""Dense and MoE decode geometry (M = 1)."""
