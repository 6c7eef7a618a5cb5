"""The read-bandwidth floor, measured in the same run as the gate (CALIBRATION.md: absolute figures
drift between machines and runs; compare against what this GPU reads right now).

Method: megart.bandwidth.read_floor, a 16-byte vector-load kernel over 4 GiB of random data (the
method CALIBRATION.md's 4.53 TB/s came from), median of 10. The method is recorded in every result.

Also here: the L2 flush between timed steps. Weights of one decode task (8-32 MB) fit in the H200's
60 MB L2, so timing the same task step after step would read them from L2 and beat HBM. In a real
decode step every weight is cold (the whole model streams through L2 between two uses), so by
default the gate reads a 256 MiB buffer between steps. The flush runs between launches, outside
every span, and never enters a measured number.
"""
from __future__ import annotations

import statistics

FLUSH_BYTES = 256 << 20


def read_floor(device=None) -> dict:
    from ..bandwidth import read_floor as measure
    return measure()


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
