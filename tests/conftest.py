"""Shared test setup: the `gpu` marker (skipped without a CUDA device; with MEGART_REQUIRE_GPU=1 a
skip is a failure, so a GPU run cannot pass by skipping) and a private compile cache per session, shared by
the session's pytest-xdist workers."""
import os

import pytest
import torch

REQUIRE_GPU = os.environ.get("MEGART_REQUIRE_GPU", "") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "xdist_group(name): run on one pytest-xdist worker with its group")
    # Under pytest-xdist (-n), tests marked xdist_group run one after another on one worker, so a group whose
    # tests build the same kernels compiles each once (its parameters spread over workers compiled them twice).
    # The controller schedules by group; each worker must also know (pytest_configure_node, below) to name its
    # tests by group, or the scheduler sees no groups. (pytest 9 ignores that naming: the test extra pins 8.)
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("megart_loadgroup"):
        config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, on the controller, per worker: pass the grouped scheduling on."""
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput["megart_loadgroup"] = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRE_GPU and rep.skipped and "gpu" in item.keywords:
        rep.outcome = "failed"
        rep.longrepr = f"MEGART_REQUIRE_GPU=1 but the GPU test was skipped: {rep.longrepr}"


@pytest.fixture(scope="session", autouse=True)
def _compile_cache(tmp_path_factory):
    if "MEGART_CACHE_DIR" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):   # (each worker's base lies in the session's: share that one)
            base = base.parent
        cache = base / "megart-cache"
        cache.mkdir(exist_ok=True)                   # (entries are written to a temp file and renamed in)
        os.environ["MEGART_CACHE_DIR"] = str(cache)
    yield


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def cpu_settings():
    """One intra-op thread: the emulator runs thousands of tiny ops, and OpenMP spin-waits make them
    crawl on a shared 2-core CI machine. Denormals flushed (softmax tails). Modules that emulate whole
    models ask for it with pytestmark = pytest.mark.usefixtures("cpu_settings")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)
