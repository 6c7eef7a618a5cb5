"""Reading safetensors bytes through a bounded host buffer (megart/models/safetensors_read.py): the chunked
path returns exactly what safetensors reads, header ranges are checked, and loading a checkpoint to a
non-CPU device keeps host memory near the staging buffer's size instead of the file's (safetensors' own
memory map would keep every touched page resident). The device here is "meta" (no data, no host memory
of its own), so all resident growth is the loader's."""
from __future__ import annotations

import gc
import json
import struct
import threading
import time

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from megart.models.hf_config import CheckpointError  # noqa: E402
from megart.models.safetensors_read import TensorReader, read_header  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _PeakRSS:
    def __enter__(self):
        gc.collect()
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


@pytest.mark.parametrize("chunk", [4096, 1000, 1 << 20])
@pytest.mark.parametrize("staged", [True, False])
def test_reads_match_safetensors(tmp_path, chunk, staged):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 129, generator=g).to(torch.bfloat16),      # odd sizes: unaligned offsets
               "b": torch.randn(7, 5, generator=g).to(torch.float16),
               "c": torch.randn(3, 1000, generator=g),
               "d": torch.randn(11, generator=g).to(torch.bfloat16)}
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    want = safetensors_torch.load_file(str(path))
    reader = TensorReader("cpu", chunk=chunk, staged=staged)
    entries = read_header(path)
    assert set(entries) == set(tensors)
    with open(path, "rb", buffering=0) as f:
        for name, e in entries.items():
            got = reader.read(f, path, name, e)
            assert got.dtype == torch.bfloat16 and got.shape == want[name].shape
            assert torch.equal(got, want[name].to(torch.bfloat16)), name
    reader.close()


def test_header_ranges_checked(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.ones(64, 64)}, str(path))
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: tensor 'w' lies at bytes .* \(truncated"):
        read_header(tmp_path / "cut.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 10]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 10)
    e = read_header(tmp_path / "short.safetensors")["w"]
    with open(tmp_path / "short.safetensors", "rb") as f, pytest.raises(CheckpointError, match="'w' spans 10 bytes"):
        TensorReader("cpu").read(f, "short.safetensors", "w", e)
    (tmp_path / "tiny.safetensors").write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="tiny.safetensors: shorter than a safetensors header"):
        read_header(tmp_path / "tiny.safetensors")


def test_host_memory_stays_near_the_buffer_not_the_file(tmp_path):
    """A 256 MB checkpoint read to a device: resident growth stays under a quarter of the file (the 8 MB
    staging buffer plus allocator noise). Reading it through safetensors' memory map instead grows by the
    whole file, which the second half shows, so the bound is one the old loader failed."""
    from megart.models.hf_load import Checkpoint
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({f"t{i}": torch.randn(2048, 4096).to(torch.bfloat16) for i in range(16)}, str(path))
    size = path.stat().st_size
    gc.collect()
    with _PeakRSS() as rss:
        with Checkpoint(tmp_path, "meta", reader=TensorReader("meta", chunk=8 << 20)) as ck:
            got = [ck.get(n) for n in sorted(ck.names())]
    assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for t in got)
    growth = rss.peak - rss.base
    assert growth < 0.25 * size, f"host RSS grew {growth / 1e6:.0f} MB reading a {size / 1e6:.0f} MB file"

    from safetensors import safe_open                       # the old path, for contrast
    with _PeakRSS() as rss:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for n in f.keys():
                f.get_tensor(n).sum()        # reads every byte out of the map, as a copy to the GPU does
    assert rss.peak - rss.base > 0.8 * size
