"""Co-residency arithmetic (sm_90 tables) and the refusal message naming the limit."""
import pytest
import torch

import megart
from megart.occupancy import blocks_per_sm, check, limits_for


def test_limits_per_resource():
    lim = limits_for("sm_90a")
    assert blocks_per_sm(32, 256, 0, lim).per_sm == 8            # threads: 2048 / 256
    occ = blocks_per_sm(128, 256, 0, lim)
    assert (occ.per_sm, occ.limiter) == (2, "registers")          # 65536 / (128 * 256)
    occ = blocks_per_sm(32, 256, 150 * 1024, lim)
    assert (occ.per_sm, occ.limiter) == (1, "shared memory")
    assert blocks_per_sm(32, 256, 230 * 1024, lim).per_sm == 0    # over the per-block limit


def test_refusal_names_the_limit():
    occ = blocks_per_sm(32, 256, 150 * 1024, limits_for("sm_90a"))
    with pytest.raises(megart.ResidencyError, match="shared memory") as ei:
        check(136, occ, 132)
    assert "nw <= 132" in str(ei.value)
    check(132, occ, 132)


def test_kernel_refuses_too_many_workers_before_launch():
    pk = megart.PersistentKernel(nw=132 * 32 + 1, device="cpu")
    pk.task("noop")
    with pytest.raises(megart.ResidencyError):
        pk.compile()


def test_two_ctas_per_sm_compiles_with_a_register_cap():
    pk = megart.PersistentKernel(nw=136, device="cpu")
    y = pk.tensor(torch.zeros(64), "y")
    pk.task("axpy", y=y, x=pk.tensor(torch.ones(64), "x"), a=1.0, tiles=8)
    pk.compile()
    assert pk.occupancy.per_sm >= 2 and pk.report.registers <= 128
