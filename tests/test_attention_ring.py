"""tasks/attention_ring.py: the attention K/V ring's geometry (positions per stage, stages) from its bytes and
the thread count. How the ring sizes a kernel's shared memory and macros: tests/test_tasks_attention.py
(test_attention_ring_config); the Llama model's choice of ring: tests/test_llama.py."""
import pytest

from megart.tasks.attention_ring import ring_geometry


@pytest.mark.parametrize("ring,threads,geometry", [(64 << 10, 256, (2, 4)), (64 << 10, 128, (4, 4)),
                                                   (32 << 10, 256, (2, 2)), (32 << 10, 128, (4, 2)),
                                                   (32 << 10, 384, (1, 2)), (64 << 10, 384, (1, 4)),
                                                   (64 << 10, 512, (1, 4)), (16 << 10, 256, (1, 2)),
                                                   (128 << 10, 256, (4, 4)),
                                                   (8 << 10, 256, (1, 1)), (0, 256, (1, 0))])
def test_attention_ring_geometry(ring, threads, geometry):
    """Positions per stage (a softmax batch) and stages of the K/V ring: 32 bytes per thread and position,
    batches of 4 / 2 / 1 from 16 / 8 / fewer positions per thread, at most 4 stages; a ring smaller than the
    default keeps the default ring's batch where two stages of it fit (32 KB at 256 threads: 2 x 2, not 1 x 4,
    which spilled the 1B kernel); under 2 stages the body takes the register path (tasks/attention_decode.cuh
    uses these as given)."""
    assert ring_geometry(ring, threads) == geometry
