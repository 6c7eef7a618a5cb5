"""--context MODEL: the candidate inside the whole model's megakernel, with its co-resident tasks.

The model's decode step is built as usual, with the candidate body overlaid for the task type under
test (source_overrides), compiled at the requested worker count with the profiler on, and run. Only
this task's spans are extracted: records whose numeric task id is the task's id AND whose instance
id belongs to a call of the requested shape (a model calls gemv_m1 for several projections; the
shape picks which). Each (step, call) is one sample: per layer, per step.

Correctness inside the model: the candidate must not change what the model computes. The model's
output after one step (logits, or the residual stream of a bare block) is compared with the same
model built with the in-tree body (megart) AND with the PyTorch reference of the model; both must
reach cosine >= 0.99. The isolated gate's whole-op check runs too (same candidate, same compile
options), because a model-level check can hide a wrong projection whose error the rest absorbs.
"""
from __future__ import annotations

from .context_names import ISOLATED, known, unknown  # noqa: F401  (the names a CLI lists and refuses)


def get(name: str):
    """None for 'isolated'; a model context object otherwise (GateError UNKNOWN_CONTEXT if unknown)."""
    if name == ISOLATED:
        return None
    from . import model_context
    return model_context.resolve(name)
