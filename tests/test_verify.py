"""The verifier: planted deadlocks are caught with the stuck task named; valid random DAGs pass."""
import pytest
import torch

import megart
from megart.schedule import build
from megart.verify import verify

import random_dag


def cpu_pk(nw=4):
    return megart.PersistentKernel(nw=nw, device="cpu")


def test_cycle_is_caught_and_named():
    pk = cpu_pk(2)
    e1, e2 = pk.event("e1"), pk.event("e2")
    pk.task("noop", waits=[e1], signals=[e2], worker=0)
    pk.task("noop", waits=[e2], signals=[e1], worker=1)
    with pytest.raises(megart.ScheduleError) as ei:
        verify(build(pk.graph))
    msg = str(ei.value)
    assert "deadlock" in msg and "noop#0" in msg and "'e1'" in msg and "'e2'" in msg
    assert {d["worker"] for d in ei.value.stuck} == {0, 1}


def test_missing_signal_is_caught():
    pk = cpu_pk(2)
    ev = pk.event("never")
    pk.task("noop", waits=[ev])
    with pytest.raises(megart.ScheduleError, match="no task signals"):
        pk.compile()


def test_wrong_count_is_caught():
    # two signallers, but the only second one sits behind the waiter on the same queue
    pk = cpu_pk(2)
    ev = pk.event("half")
    pk.task("noop", signals=[ev], worker=0)
    pk.task("noop", waits=[ev], worker=1)
    pk.task("noop", signals=[ev], worker=1)
    with pytest.raises(megart.ScheduleError) as ei:
        verify(build(pk.graph))
    assert ei.value.stuck[0]["have"] == 1 and ei.value.stuck[0]["need"] == 2


def test_queue_order_deadlock_with_pinned_workers():
    pk = cpu_pk(2)
    a, b = pk.event("a"), pk.event("b")
    pk.task("noop", waits=[a], worker=0)      # worker 0 waits for a, which worker 1 only signals
    pk.task("noop", signals=[b], worker=0)    # after it waited for b
    pk.task("noop", waits=[b], worker=1)
    pk.task("noop", signals=[a], worker=1)
    with pytest.raises(megart.ScheduleError):
        verify(build(pk.graph))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("nw", [1, 3, 16])
def test_random_dags_verify(seed, nw):
    pk = cpu_pk(nw)
    random_dag.build(pk, seed, calls=40, size=512)
    verify(build(pk.graph))


def test_barrier_orders_everything():
    pk = cpu_pk(3)
    t = pk.tensor(torch.zeros(8), "t")
    pk.task("spin", ns=10, tiles=5)
    g = pk.barrier()
    s = build(pk.graph)
    assert all(len([u for u in q if u in g.uids]) == 1 for q in s.queues)
    order = __import__("megart.verify", fromlist=["simulate"]).simulate(s)
    first_barrier = min(order.index(u) for u in g.uids)
    assert first_barrier >= 5 - 3  # barrier arrivals on a queue come after that queue's spins
    del t
