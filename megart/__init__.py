"""megart: an LLM decode step (or any graph of GPU tasks) as one persistent CUDA megakernel."""
from .errors import (CompileError, ConfigError, DeviceError, GraphError, HangError, InputError, MegartError,
                     RegistryError, ResidencyError, ScheduleError)
from .kernel import PersistentKernel
from .registry import Cost, Param, TaskType, ptr, register_task, scalar
from . import tasks as _builtin_tasks  # noqa: E402,F401  (registers the built-in task types, before any user type)

__all__ = ["PersistentKernel", "register_task", "TaskType", "Param", "ptr", "scalar", "Cost", "MegartError",
           "GraphError", "ConfigError", "InputError", "RegistryError", "ScheduleError", "CompileError",
           "ResidencyError", "DeviceError", "HangError"]
__version__ = "0.1.0"
