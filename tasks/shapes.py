"""Shape checks for task arguments declared as matrices. An element count alone lets a transposed
or mis-reshaped weight through (an [K, N] matrix has the same numel as [N, K]), so wherever a task
declares a shape, a whole tensor with more than one dimension must have exactly that shape. A flat
(1-D) tensor or a slice carries no shape of its own and is taken as row-major, checked by count."""
from __future__ import annotations

from ..tensors import TensorRef
from .tiling import require


def check_shape(task: str, r: TensorRef, name: str, shape: tuple, what: str = "") -> None:
    """`r` must be a whole tensor of exactly `shape`, or carry no shape (1-D or a slice)."""
    t = r.tensor
    whole = r.offset == 0 and r.count == t.numel
    if whole and len(t.shape) > 1:
        require(tuple(t.shape) == tuple(shape), task,
                f"{name} ({t.name!r}) has shape {tuple(t.shape)}, expected {tuple(shape)}"
                + (f" ({what})" if what else "") + "; a transposed or reshaped tensor has the right element count "
                "but the wrong layout")
