"""megart: an LLM decode step (or any graph of GPU tasks) as one persistent CUDA megakernel."""
from .sources import TASKS_DIR as _TASKS_DIR


def _load_builtin_tasks():
    """Import megart.tasks (which registers the built-in task types, before any user type) from the device
    tree's tasks/ folder, where each declaration sits next to its .cuh body (megart/sources.py says where)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(__name__ + ".tasks", _TASKS_DIR / "__init__.py",
                                                  submodule_search_locations=[str(_TASKS_DIR)])
    if spec is None:
        raise ImportError(f"megart's built-in task types are missing: no {_TASKS_DIR / '__init__.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


tasks = _load_builtin_tasks()   # first, so every later import of megart.tasks.* finds it

from .errors import (CompileError, ConfigError, DeviceError, GraphError, HangError, InputError,  # noqa: E402
                     MegartError, RegistryError, ResidencyError, ScheduleError)
from .kernel import PersistentKernel  # noqa: E402
from .registry import Cost, Param, TaskType, ptr, register_task, scalar  # noqa: E402
from . import tagged  # noqa: E402,F401  (megart.tagged: tagged tensors' words)

__all__ = ["PersistentKernel", "register_task", "TaskType", "Param", "ptr", "scalar", "Cost", "MegartError",
           "GraphError", "ConfigError", "InputError", "RegistryError", "ScheduleError", "CompileError",
           "ResidencyError", "DeviceError", "HangError"]
__version__ = "0.1.0"
