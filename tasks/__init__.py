"""Built-in task types. Importing this package registers them (megart.registry does it lazily).
Id ranges: 1-15 runtime and synthetic, 16-63 dense decode tasks, 64-95 attention tasks, 96-111 model
bookkeeping, 112-127 tensor-parallel exchange."""
from . import synthetic  # noqa: F401
from . import dense  # noqa: F401
from . import qkv  # noqa: F401
from . import attention  # noqa: F401
from . import control  # noqa: F401
from . import peer  # noqa: F401
