"""Every exception a megart user can see. One module so callers can catch by kind."""


class MegartError(Exception):
    """Base class of all megart errors."""


class GraphError(MegartError, ValueError):
    """The task graph is malformed: bad tensor, bad parameter, unknown task, shape a task refuses."""


class ConfigError(GraphError):
    """An option of PersistentKernel, or a MEGART_* environment variable, is invalid."""


class InputError(MegartError, ValueError):
    """A value handed to a run (a token id, a model input, a step count) is outside what it accepts."""


class RegistryError(MegartError, ValueError):
    """A task type declaration is invalid or clashes with an existing one."""


class ScheduleError(MegartError):
    """The schedule cannot complete: some wait can never be satisfied (a deadlock)."""

    def __init__(self, message: str, stuck=None):
        super().__init__(message)
        #: list of dicts (worker, position, task, instance, event, have, need) for each stuck queue head
        self.stuck = stuck or []


class CompileError(MegartError):
    """NVRTC rejected the generated source. The message carries the log mapped to task sources."""

    def __init__(self, message: str, log: str = "", source: str = ""):
        super().__init__(message)
        self.log = log
        self.source = source


class ResidencyError(MegartError):
    """The requested workers cannot all be co-resident, so a cooperative launch would fail or hang."""


class DeviceError(MegartError):
    """No usable CUDA device, or an operation needs one that is absent."""


class HangError(MegartError):
    """The kernel's watchdog fired: a spin wait exceeded its limit. `record` says who waited on what."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}
