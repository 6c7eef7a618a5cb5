"""Tensor bytes of a safetensors file, read with plain file reads through a small reusable host buffer.

Why not `safe_open(...).get_tensor()`: safetensors memory-maps the file, and every page a tensor's copy
touches stays resident in this process (counted in its RSS) until the file is closed, so loading a model
onto the GPU that way holds the whole file in host memory at the end. Plain reads go through the page
cache (the kernel's, reclaimable, not this process's), and the host side holds at most two chunks
(`CHUNK` bytes each, pinned on CUDA so the copies are real DMA, double-buffered so reading the next chunk
overlaps copying the last).

The layout read here is the safetensors format's: an 8-byte little-endian header length N, N bytes of
JSON ({name: {dtype, shape, data_offsets: [begin, end]}} relative to the data, which starts at 8 + N).
safetensors itself still opens and validates each file (megart.models.hf_load); this module only needs
the offsets, which its Python API does not expose.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from .hf_config import CheckpointError

__all__ = ["CHUNK", "Entry", "TensorReader", "read_header"]

CHUNK = 64 << 20           # bytes per host staging buffer (two of them on CUDA)
MAX_HEADER = 100 << 20     # safetensors' own limit on the JSON header

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int                 # absolute byte offsets in the file
    end: int


def read_header(path) -> dict[str, Entry]:
    """{tensor name: Entry} of one safetensors file, every range checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: shorter than a safetensors header ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: header is not JSON ({e})") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in h["data_offsets"])
            e = Entry(str(h["dtype"]), tuple(int(s) for s in h["shape"]), 8 + n + begin, 8 + n + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: header entry of {name!r} is malformed ({exc!r})") from None
        if not 8 + n <= e.begin <= e.end <= size:
            raise CheckpointError(f"{path}: tensor {name!r} lies at bytes [{e.begin}, {e.end}) of a "
                                  f"{size}-byte file (truncated?)")
        out[name] = e
    return out


class TensorReader:
    """Reads tensors (by Entry) from open files onto `device` as bf16.

    CPU: straight into the tensor's own allocation (the destination is host memory anyway).
    Otherwise: the raw bytes are allocated on the device and filled chunk by chunk through the staging
    buffers, then viewed as their dtype and converted to bf16 there. `staged=True` forces the chunked
    path on the CPU too (tests)."""

    def __init__(self, device, chunk: int = CHUNK, staged: bool | None = None):
        self.device = torch.device(device)
        self.chunk = int(chunk)
        self.staged = self.device.type != "cpu" if staged is None else bool(staged)
        self._bufs: list[torch.Tensor] = []
        self._events: list = []

    def _buffers(self):
        if not self._bufs:
            cuda = self.device.type == "cuda"
            self._bufs = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2 if cuda else 1)]
            self._events = [None] * len(self._bufs)
        return self._bufs

    def read(self, f, path, name: str, e: Entry) -> torch.Tensor:
        """Tensor `name` (Entry e) of the open binary file f (at `path`, for messages), bf16 on the device."""
        if e.dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} is {e.dtype}; megart reads {', '.join(sorted(DTYPES))}")
        dtype = DTYPES[e.dtype]
        nbytes = e.end - e.begin
        want = math.prod(e.shape) * dtype.itemsize
        if nbytes != want:
            raise CheckpointError(f"{path}: tensor {name!r} spans {nbytes} bytes; shape {list(e.shape)} of "
                                  f"{e.dtype} needs {want}")
        if self.staged:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staged_into(f, path, name, e.begin, raw)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            self._read_exact(f, path, name, e.begin, memoryview(raw.numpy()))
        t = raw.view(dtype).view(e.shape)
        return t if dtype == torch.bfloat16 else t.to(torch.bfloat16)

    def _staged_into(self, f, path, name, offset: int, raw: torch.Tensor) -> None:
        bufs = self._buffers()
        cuda = self.device.type == "cuda"
        for i, at in enumerate(range(0, raw.numel(), self.chunk)):
            k = i % len(bufs)
            if self._events[k] is not None:
                self._events[k].synchronize()     # the copy out of this buffer has finished
            n = min(self.chunk, raw.numel() - at)
            buf = bufs[k][:n]
            self._read_exact(f, path, name, offset + at, memoryview(buf.numpy()))
            raw[at:at + n].copy_(buf, non_blocking=cuda)
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._events[k] = ev

    @staticmethod
    def _read_exact(f, path, name, offset: int, view: memoryview) -> None:
        f.seek(offset)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{path}: tensor {name!r} ends past the end of the file (truncated?)")
            got += n

    def close(self) -> None:
        """Wait for the last copies and drop the staging buffers."""
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._bufs, self._events = [], []
