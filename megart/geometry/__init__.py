"""Decode-geometry input builders: seeded, scaled random weights (randn / sqrt(fan_in), never zeros)
and the activations a batch-1 decode step sees (M = 1; one live row per active MoE expert; one
query token against the real KV length)."""
from .dense import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
