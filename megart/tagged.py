"""Tagged tensors: bf16 vectors a consumer reads by polling instead of waiting on an event.

Each element is one 32-bit word: the bf16 value in the low 16 bits and the tag of the step that wrote it in
the high 16 (megart.layout.step_tag). The writer stores whole words (value and tag land together); a reader
spins until every word it needs carries the current step's tag. So the reader needs no event wait and the
writer, when nothing else waits on it, no release fence and no signal: that is what a call boundary costs
on the critical path of a decode step (docs/ARCHITECTURE.md, "Tagged tensors").

    h = megart.tagged.empty(ffn, device="cuda")        # zeroed words: no tag matches
    pk.tensor(h, "h", tagged=True)                     # pass it where a task accepts a tagged operand
    megart.tagged.values(h)                            # the bf16 values (a strided view, no copy)

Rules the graph enforces: a tagged tensor's bytes are written by at most one instance per step, a polled
read follows the write of every byte it reads, and only parameters declared tagged=True take one. A tagged
tensor belongs to the one kernel that writes it: the kernel zeroes it when it is set up on the GPU and after
an abort (its steps count from 1 again), and nothing else should write it.
"""
from __future__ import annotations

import torch

from .layout import TAG_MARK, TAG_MASK, step_tag  # noqa: F401  (re-exported: the word format)


def empty(n: int, device=None) -> torch.Tensor:
    """A tagged vector of n values, zeroed (a zero word's tag matches no step)."""
    return torch.zeros(int(n), dtype=torch.int32, device=device)


def values(words: torch.Tensor) -> torch.Tensor:
    """The bf16 values of tagged words, as a view (writes through it keep the tags)."""
    if words.dtype != torch.int32:
        raise TypeError(f"tagged words are torch.int32, got {words.dtype}")
    return words.view(-1).view(torch.bfloat16)[0::2]


def tags(words: torch.Tensor) -> torch.Tensor:
    """The 16-bit tags of tagged words (int32, 0..65535)."""
    return (words.view(-1) >> 16) & 0xFFFF


def pack(vals: torch.Tensor, gen: int) -> torch.Tensor:
    """Tagged words holding bf16 `vals` as written in step `gen`."""
    bits = vals.to(torch.bfloat16).contiguous().view(-1).view(torch.int16).to(torch.int32) & 0xFFFF
    return bits | high_half(gen)


def high_half(gen: int) -> int:
    """Step `gen`'s tag in the high half of a word, as the signed int32 value torch stores."""
    v = step_tag(gen) << 16
    return v - (1 << 32) if v >= 1 << 31 else v


def stamp(words: torch.Tensor, gen: int) -> None:
    """Give tagged words, in place, step `gen`'s tag (their values kept)."""
    words.copy_((words & 0xFFFF) | high_half(gen))
