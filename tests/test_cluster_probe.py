"""bench/cluster_probe.py on the CPU (the probe itself times a GPU): its kernels compile for sm_90a, the
cluster-scope PTX (mapa, st.release.cluster.shared::cluster, barrier.cluster) included."""
import importlib.util
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "bench" / "cluster_probe.py"


def test_the_probe_kernels_compile_for_hopper():
    spec = importlib.util.spec_from_file_location("cluster_probe_mod", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("coresident", "pingpong_dsmem", "pingpong_global", "cluster_barrier"):
        assert f"__global__ void {name}(" in mod.KERNELS
    assert len(bytes(mod.compile_probe().code)) > 1000
