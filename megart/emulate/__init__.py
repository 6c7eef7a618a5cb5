"""Emulation: running a schedule without a GPU, in one place.

* reference.py: the emulator. Each instance runs its task type's Python reference on host copies of the
  tensors, in a legal interleaving of the queues: proves the graph and the numerics plan.
* hostsim.py: the host simulation. The CUDA bodies themselves of the task types declared hostsim=True (dense
  and attention), compiled with g++ over a prelude that models one CTA: proves the device code, the weight
  stream's protocol included.
* ranks.py: every rank of a tensor-parallel group in one joint interleaving, through the same references.
"""
from .reference import emulate  # noqa: F401
