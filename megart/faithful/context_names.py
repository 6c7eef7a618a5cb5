"""The context names the faithful gate knows (isolated, llama_<config>) and the error for an unknown one:
apart from context.py (which resolves a name to its model context), so model_context.py can use them
without importing its caller."""
from __future__ import annotations

import importlib

from .codes import UNKNOWN_CONTEXT, GateError

ISOLATED = "isolated"


def _llama_configs() -> dict:
    try:
        cfgmod = importlib.import_module("megart.models.llama_config")
    except Exception:
        return {}
    return dict(getattr(cfgmod, "CONFIGS", {}))


def known() -> list[str]:
    """Model context names (llama_<config>) that this checkout can build."""
    if not _llama_available():
        return []
    return [f"llama_{k}" for k in _llama_configs()]


def _llama_available() -> bool:
    try:
        importlib.import_module("megart.models.llama")
        return True
    except Exception:
        return False


def unknown(name: str, why: str) -> GateError:
    avail = ", ".join([ISOLATED] + known())
    return GateError(UNKNOWN_CONTEXT, f"--context {name!r}: {why}. Available contexts: {avail}.")
