"""Peer events on the CPU (docs/TP.md): declaring and signalling them, the per-rank and joint verifiers,
the joint emulator with shared peer buffers, descriptor encoding, and the tensor-parallel kernel build."""
import numpy as np
import pytest
import torch

import megart
from megart.emulate.ranks import emulate_ranks
from megart.errors import GraphError, ScheduleError
from megart.launch import pack_descriptors
from megart.layout import HEADER_INTS, header_offsets, peer_signal_word, peer_wait_word
from megart.peer_memory import HostPeers
from megart.verify import verify_ranks

N = 64


def rank_kernel(peers, r, nw=4, signal=True, wait=True, copy_tiles=2):
    """y = x_0 + x_1 on every rank: x_r into slot r, slot r to the peer, tp_sum of both slots."""
    world = peers.world
    peers.declare("red", world * N, torch.bfloat16)
    peers.allocate()
    pk = megart.PersistentKernel(nw=nw, device="cpu", peers=peers)
    red = peers.local("red")
    x = torch.randn(N, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    tx, tred = pk.tensor(x, "x"), pk.tensor(red, "red")
    ty = pk.tensor(torch.zeros(N, dtype=torch.bfloat16), "y")
    ev = pk.peer_event("red")
    g = pk.task("tp_sum", infer=False, y=tred.ref(r * N, N), parts=tx, tp=1, tiles=2)   # (a one-rank sum: a copy)
    slot = pk.tensor(red.view(torch.int32), "red_words")
    for q in range(world):
        if q != r and signal:
            peer = pk.tensor(peers.remote(q, "red").view(torch.int32), f"red_on{q}")
            pk.task("peer_copy", infer=False, after=[g], dst=peer.ref(r * N // 2, N // 2),
                    src=slot.ref(r * N // 2, N // 2), signals=[ev.to(q)], tiles=copy_tiles)
    pk.task("tp_sum", infer=False, after=[g], waits=[ev] if wait else [], y=ty, parts=tred, tp=world, tiles=3)
    return pk, x


def test_two_ranks_all_reduce_emulated_bit_identical():
    peers = HostPeers(2)
    built = [rank_kernel(peers.rank(r), r) for r in range(2)]
    kernels = [pk.compile() for pk, _ in built]
    verify_ranks([pk.schedule for pk in kernels])
    hosts = emulate_ranks(kernels, steps=2, seed=3)
    want = (built[0][1].float() + built[1][1].float()).to(torch.bfloat16)
    for h in hosts:
        assert torch.equal(h["y"], want)
    assert torch.equal(hosts[0]["y"], hosts[1]["y"])


def test_peer_event_counts_and_descriptor_words():
    peers = HostPeers(2)
    pk, _ = rank_kernel(peers.rank(0), 0, copy_tiles=3)
    pk.compile()
    s = pk.schedule
    assert s.events[0].peer and s.events[0].name == "peer red" and s.events[0].count == 3
    desc, _ = pack_descriptors(s)
    hdr = desc[:, : HEADER_INTS // 2].view(np.int32)
    off = header_offsets()
    sig = hdr[:, off["signal_event"]:off["signal_event"] + 4]
    waits = hdr[:, off["wait_event"]:off["wait_event"] + 4]
    assert (sig == peer_signal_word(0, 1)).sum() == 3        # one per peer_copy instance, to rank 1
    assert (waits == peer_wait_word(0)).sum() == 3           # every tp_sum instance waits on it
    assert peer_signal_word(5, 3) == -1 - (5 | 3 << 24)


def test_dangling_peer_wait_is_rejected():
    peers = HostPeers(2)
    pk, _ = rank_kernel(peers.rank(0), 0, signal=False)
    with pytest.raises(ScheduleError, match="dangling peer wait") as e:
        pk.compile()
    assert "peer red" in str(e.value)


def test_joint_verifier_counts_each_peer():
    peers = HostPeers(2)
    a, _ = rank_kernel(peers.rank(0), 0, copy_tiles=2)
    b, _ = rank_kernel(peers.rank(1), 1, copy_tiles=1)   # rank 1 sends fewer signals than rank 0 expects
    a.compile()
    b.compile()
    with pytest.raises(ScheduleError, match=r"rank 0 waits on 'peer red' for 2 signals per step, but its peers send 1"):
        verify_ranks([a.schedule, b.schedule])
    with pytest.raises(ScheduleError, match="ranks 0..1"):
        verify_ranks([a.schedule, a.schedule])


def test_joint_deadlock_names_rank():
    """Rank 1 waits on the peer event before it signals, and so does rank 0: neither can start."""
    peers = HostPeers(2)
    kernels = []
    for r in range(2):
        p = peers.rank(r)
        p.declare("w", 8, torch.int32)
        p.allocate()
        pk = megart.PersistentKernel(nw=1, device="cpu", peers=p)
        ev = pk.peer_event("e")
        src = pk.tensor(torch.zeros(8, dtype=torch.int32), "src")
        dst = pk.tensor(p.remote(1 - r, "w"), "dst")
        pk.task("peer_copy", infer=False, dst=dst, src=src, waits=[ev], signals=[ev.to(1 - r)])
        kernels.append(pk.compile(verify=False))
    with pytest.raises(ScheduleError, match="rank 0 worker 0") as e:
        verify_ranks([k.schedule for k in kernels])
    assert {d["rank"] for d in e.value.stuck} == {0, 1}


def test_peer_event_api_errors():
    peers = HostPeers(2)
    p = peers.rank(0)
    pk = megart.PersistentKernel(nw=2, device="cpu", peers=p)
    ev = pk.peer_event("a")
    t = pk.tensor(torch.zeros(8, dtype=torch.int32), "t")
    u = pk.tensor(torch.zeros(8, dtype=torch.int32), "u")
    with pytest.raises(GraphError, match=r"signalled on another rank: signals=\[ev.to\(rank\)\]"):
        pk.task("peer_copy", dst=t, src=u, signals=[ev])
    with pytest.raises(GraphError, match="names no peer"):
        pk.task("peer_copy", dst=t, src=u, signals=[ev.to(0)])
    with pytest.raises(GraphError, match="not .to"):
        pk.task("peer_copy", dst=t, src=u, waits=[ev.to(1)])
    with pytest.raises(GraphError, match="already exists"):
        pk.peer_event("a")
    with pytest.raises(GraphError, match="only a peer_event"):
        pk.event("local").to(1)
    with pytest.raises(GraphError, match="not part of a tensor-parallel group"):
        megart.PersistentKernel(nw=2, device="cpu").peer_event("x")
    with pytest.raises(GraphError, match="world >= 2"):
        HostPeers(1).rank(0)


def test_tp_kernel_compiles_with_peer_paths_only_when_used():
    peers = HostPeers(2)
    pk, _ = rank_kernel(peers.rank(0), 0, nw=132)
    pk.compile()
    assert "#define MEGART_TP 2" in pk.source.text
    assert pk.report.spill_stores == 0 and pk.report.spill_loads == 0
    plain = megart.PersistentKernel(nw=4, device="cpu")
    x = plain.tensor(torch.zeros(64), "x")
    y = plain.tensor(torch.zeros(64), "y")
    plain.task("copy", dst=y, src=x)
    plain.compile()
    assert "#define MEGART_TP" not in plain.source.text


def test_gemv_partial_and_tp_argmax_bodies_in_the_host_simulation():
    """The CUDA bodies themselves (g++, one CTA as fibers): gemv_partial's f32 rows, also stored into the
    peer slot, and tp_argmax_reduce's global index, against the references."""
    from megart.emulate import hostsim
    g = torch.Generator().manual_seed(5)
    n, k = 96, 512
    pk = megart.PersistentKernel(nw=8, device="cpu")
    w = pk.tensor((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16), "w")
    x = pk.tensor(torch.randn(k, generator=g).to(torch.bfloat16), "x")
    y = pk.tensor(torch.zeros(n), "y")
    peer = pk.tensor(torch.zeros(n), "peer")
    pk.task("gemv_partial", y=y, w=w, x=x, peer=peer, tiles=5)
    parts = torch.zeros(2 * 2 * 3, dtype=torch.int32)
    vals = torch.tensor([[0.5, 2.0, -1.0], [2.0, float("nan"), 1.0]])
    rows = torch.tensor([[4, 9, 1], [3, 7, 0]], dtype=torch.int32)
    for r in range(2):
        parts[r * 6:r * 6 + 3] = vals[r].view(torch.int32)
        parts[r * 6 + 3:r * 6 + 6] = rows[r]
    tp = pk.tensor(parts, "parts")
    tok = pk.tensor(torch.zeros(1, dtype=torch.int32), "tok")
    pk.task("tp_argmax_reduce", token=tok, parts=tp, n=3, tp=2, vocab_per_rank=10)
    pk.compile()
    assert pk.report.spill_bytes == 0
    want = w.data.float() @ x.data.float()
    out = hostsim.run(pk, seed=2)
    assert torch.allclose(out["y"], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out["peer"], out["y"])
    assert int(out["tok"][0]) == 9           # 2.0 at rank 0 row 9 and rank 1 row 3 (= 13): lowest id wins
    emu = pk.emulate()
    assert torch.equal(emu["tok"], out["tok"]) and torch.allclose(emu["y"], out["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lean", ["0", "1"])
def test_both_signal_fence_forms_compile_with_peer_signals(monkeypatch, lean):
    """An instance's signals behind one release fence (MEGART_LEAN_SYNC=1, the default: system scope when one of
    them goes to a peer, then relaxed adds) or one red.release each (0): both compile without spills in a
    kernel with local and peer signals, and the source carries the choice."""
    monkeypatch.setenv("MEGART_DEFINES", f"MEGART_LEAN_SYNC={lean}")
    pk, _ = rank_kernel(HostPeers(2).rank(0), 0, nw=4)
    pk.compile()
    assert f"#define MEGART_LEAN_SYNC {lean}" in pk.source.text
    assert pk.report.spill_stores == 0 and pk.report.spill_loads == 0
