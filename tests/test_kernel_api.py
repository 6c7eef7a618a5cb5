"""Every bad input a user can give the graph API gets a clear error, before any launch."""
import pytest
import torch

import megart


def pk(nw=4):
    return megart.PersistentKernel(nw=nw, device="cpu")


def test_bad_constructor_arguments():
    with pytest.raises(megart.GraphError):
        megart.PersistentKernel(nw=0, device="cpu")
    with pytest.raises(megart.GraphError):
        megart.PersistentKernel(nw=4, device="cpu", threads=100)
    with pytest.raises(megart.GraphError):
        megart.PersistentKernel(nw=4, device="cpu", watchdog_s=0)
    with pytest.raises(megart.DeviceError):
        megart.PersistentKernel(nw=4, device="mps")


def test_tensor_checks():
    k = pk()
    with pytest.raises(megart.GraphError, match="not contiguous"):
        k.tensor(torch.zeros(4, 4).t())
    with pytest.raises(megart.GraphError, match="not supported"):
        k.tensor(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(megart.GraphError, match="expected a torch tensor"):
        k.tensor([1, 2, 3])
    with pytest.raises(megart.GraphError, match="empty"):
        k.tensor(torch.zeros(0))
    k.tensor(torch.zeros(4), "a")
    with pytest.raises(megart.GraphError, match="already exists"):
        k.tensor(torch.zeros(4), "a")


def test_task_argument_checks():
    k = pk()
    f = k.tensor(torch.zeros(8), "f")
    i = k.tensor(torch.zeros(8, dtype=torch.int32), "i")
    with pytest.raises(megart.RegistryError, match="unknown task name"):
        k.task("no_such_task")
    with pytest.raises(megart.GraphError, match="needs f32"):
        k.task("copy", dst=i, src=f)
    with pytest.raises(megart.GraphError, match="source has 4 elements"):
        k.task("copy", dst=f, src=f.ref(0, 4))
    with pytest.raises(megart.GraphError, match="outside tensor"):
        f.ref(6, 4)
    with pytest.raises(megart.GraphError, match="worker 9"):
        k.task("noop", worker=9)
    with pytest.raises(megart.GraphError, match="bad arguments"):
        k.task("copy", dst=f, source=f)
    other = megart.PersistentKernel(nw=2, device="cpu").tensor(torch.zeros(8), "g")
    with pytest.raises(megart.GraphError, match="not added to this kernel"):
        k.task("copy", dst=f, src=other)
    foreign = megart.PersistentKernel(nw=2, device="cpu").event("x")
    with pytest.raises(megart.GraphError, match="events made by this kernel"):
        k.task("noop", waits=[foreign])


def test_compile_once_and_run_needs_gpu():
    k = pk()
    with pytest.raises(megart.GraphError, match="no tasks"):
        k.compile()
    k.task("noop")
    with pytest.raises(megart.GraphError, match="compile"):
        k.emulate()
    k.compile()
    with pytest.raises(megart.GraphError, match="compiled"):
        k.task("noop")
    if not torch.cuda.is_available():
        with pytest.raises(megart.DeviceError, match="needs a GPU"):
            k()


def test_user_task_registration(tmp_path):
    src = tmp_path / "scale.cuh"
    src.write_text("__device__ __forceinline__ void megart_task_scale2(const megart_params_scale2& p, char*) {\n"
                   "  for (int i = threadIdx.x; i < p.n; i += blockDim.x) p.y[i] = 2.f * p.y[i];\n}\n")
    params = [megart.ptr("y", "f32", "inout"), megart.scalar("n")]
    ref = lambda p: p.y.mul_(2)  # noqa: E731
    with pytest.raises(megart.RegistryError, match="reserved"):
        megart.register_task("scale2", 7, params, src, ref)
    with pytest.raises(megart.RegistryError, match="not found"):
        megart.register_task("scale2", 1001, params, tmp_path / "missing.cuh", ref)
    t = megart.register_task("scale2", 1001, params, src, ref)
    assert megart.register_task("scale2", 1001, params, src, ref) is t
    with pytest.raises(megart.RegistryError, match="already taken"):
        megart.register_task("scale3", 1001, params, src, ref)
    k = pk(2)
    y = k.tensor(torch.arange(8.0), "y")
    k.task("scale2", y=y, n=8)
    k.compile()
    assert torch.equal(k.emulate()["y"], torch.arange(8.0) * 2)
    assert megart.registry.get(1001).name == "scale2"


def test_a_weight_must_not_be_written(tmp_path):
    k = pk()
    w = k.tensor(torch.randn(64, 64).to(torch.bfloat16), "w")
    x = k.tensor(torch.randn(64).to(torch.bfloat16), "x")
    y = k.tensor(torch.zeros(64).to(torch.bfloat16), "y")
    k.task("gemv_m1", y=y, w=w, x=x, tiles=2)
    with pytest.raises(megart.GraphError, match="read-only"):
        k.task("gemv_m1", y=w.ref(0, 64), w=w, x=x)       # writes a tensor another task reads as a weight
    k2 = pk()
    w2 = k2.tensor(torch.randn(64, 64).to(torch.bfloat16), "w")
    x2 = k2.tensor(torch.randn(64).to(torch.bfloat16), "x")
    y2 = k2.tensor(torch.zeros(64).to(torch.bfloat16), "y")
    k2.task("silu_mul", h=w2.ref(0, 64), g=x2, u=x2)       # written first...
    with pytest.raises(megart.GraphError, match="read-only"):
        k2.task("gemv_m1", y=y2, w=w2, x=x2)               # ...then read as a weight


def test_a_call_knows_its_cost():
    """A call keeps its arguments, so its cost is its task type's cost model of that very call (what the
    faithful gate's model context reports per call); a type without a cost model has none."""
    k = pk()
    f, g = k.tensor(torch.zeros(64), "f"), k.tensor(torch.zeros(64), "g")
    call = k.task("copy", dst=f.ref(0, 16), src=g.ref(0, 16), tiles=2)
    assert call.cost().bytes == 2 * 16 * 4
    assert call.args["dst"].count == 16
    assert k.task("noop").cost() is None


def test_a_launch_overlaps_only_the_kernels_own_previous_launch():
    """launch(overlap=True) is an overlapped launch (its weight stream may start before the work ahead of it on
    the stream ends) only right after this kernel's own launch: never the first, never after
    order_next_launch(), and __call__ overlaps its second and later steps."""
    k = pk()
    k.task("noop")
    k.compile()
    seen = []

    class Runtime:   # (the device runtime's launch, recorded)
        def launch(self, watchdog_ns, overlap):
            seen.append(overlap)

    k._rt = Runtime()
    k.launch(overlap=True)
    k.launch(overlap=True)
    k.launch()
    k.launch(overlap=True)
    k.order_next_launch()
    k.launch(overlap=True)
    assert seen == [False, True, False, True, False]
    seen.clear()
    k.order_next_launch()
    k.launch()
    k.launch()
    assert seen == [False, False]
