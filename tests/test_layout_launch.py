"""Host/device layout agreement without a GPU: the generated header's constants come from layout.py,
and descriptors are packed word for word as the device reads them."""
import re
import struct

import numpy as np
import torch

import megart
from megart import layout
from megart.launch import pack_descriptors


def test_layout_header_constants_match_python():
    text = layout.layout_header()
    consts = dict(re.findall(r"constexpr int (k\w+) = (\d+);", text))
    assert int(consts["kDescWords"]) == layout.DESC_WORDS
    assert int(consts["kMaxWaits"]) == layout.MAX_WAITS and int(consts["kMaxSignals"]) == layout.MAX_SIGNALS
    for name, idx in layout.CTRL.items():
        assert int(consts[f"kCtrl_{name}"]) == idx
    for name, idx in layout.SPAN.items():
        assert int(consts[f"kSpan_{name}"]) == idx
    for name, idx in layout.header_offsets().items():
        assert int(consts[f"kHdr_{name}"]) == idx
    assert f"sizeof(TaskDesc) == {layout.DESC_BYTES}" in text


def test_descriptors_are_packed_as_the_device_reads_them():
    pk = megart.PersistentKernel(nw=3, device="cpu")
    x = pk.tensor(torch.arange(12, dtype=torch.float32), "x")
    y = pk.tensor(torch.zeros(12), "y")
    a = pk.task("axpy", y=y, x=x, a=-1.5, tiles=3)
    pk.barrier()
    pk.task("copy", dst=x, src=y, tiles=2)
    pk.compile()
    s = pk.schedule
    desc, starts = pack_descriptors(s)
    assert desc.shape == (s.total_instances, layout.DESC_WORDS) and starts[-1] == s.total_instances
    assert list(np.diff(starts)) == [len(q) for q in s.queues]
    hdr = desc[:, : layout.HEADER_INTS // 2].view(np.int32)
    params = desc[:, layout.HEADER_INTS // 2:]
    off = layout.header_offsets()
    row = 0
    for w, q in enumerate(s.queues):
        for pos, uid in enumerate(q):
            inst = s.instances[uid]
            h = hdr[row]
            assert (h[off["type"]], h[off["instance"]], h[off["queue_pos"]]) == (inst.type.id, uid, pos)
            assert list(h[off["wait_event"]:off["wait_event"] + h[off["n_wait"]]]) == s.waits[uid]
            assert list(h[off["signal_event"]:off["signal_event"] + h[off["n_signal"]]]) == s.signals[uid]
            for k in range(h[off["n_wait"]]):
                assert h[off["wait_count"] + k] == s.events[s.waits[uid][k]].count
            assert h[off["flags"]] == (layout.FLAG_SIGNAL_FIRST if inst.is_barrier else 0)
            if uid in a.uids:                     # axpy params: y, x, a (f32 bits), n
                p = inst.params
                assert params[row, 0] == p["y"].address and params[row, 1] == p["x"].address
                assert struct.unpack("<f", struct.pack("<I", int(params[row, 2]) & 0xffffffff))[0] == -1.5
                assert params[row, 3] == p["n"]
            row += 1


def test_absent_optional_pointer_is_null():
    pk = megart.PersistentKernel(nw=2, device="cpu")
    w = pk.tensor(torch.randn(16, 64).to(torch.bfloat16), "w")
    x = pk.tensor(torch.randn(64).to(torch.bfloat16), "x")
    y = pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y")
    pk.task("gemv_m1", y=y, w=w, x=x, tiles=2)
    pk.compile()
    desc, _ = pack_descriptors(pk.schedule)
    t = megart.registry.get("gemv_m1")
    j_res = [p.name for p in t.params].index("residual")
    params = desc[:, layout.HEADER_INTS // 2:]
    assert (params[:, j_res] == 0).all()
