"""The L2 flush between timed steps. (The read floor the gate compares with is measured in the same
run by megart.bandwidth.read_floor: 16-byte loads over 4 GiB of random data, the method the
4.53 TB/s of docs/METHOD.md came from; its method is recorded in every result.) Weights of one decode task (8-32 MB) fit in the H200's
60 MB L2, so timing the same task step after step would read them from L2 and beat HBM. In a real
decode step every weight is cold (the whole model streams through L2 between two uses), so by
default the gate reads a 256 MiB buffer between steps. The flush runs between launches, outside
every span, and never enters a measured number.
"""
from __future__ import annotations

FLUSH_BYTES = 256 << 20


class L2Flush:
    """Reads a buffer larger than L2 on the current stream (clean lines: no write-back lands on the next
    task's time)."""

    def __init__(self, device, nbytes: int = FLUSH_BYTES):
        import torch
        self.buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        self.sink = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        import torch
        torch.sum(self.buf, dim=0, out=self.sink)
