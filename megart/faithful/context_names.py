"""The context names the faithful gate knows (isolated, llama_<config>) and the error for an unknown one:
apart from context.py (which resolves a name to its model context), so model_context.py can use them
without importing its caller."""
from __future__ import annotations

from ..models.llama_config import CONFIGS
from .codes import UNKNOWN_CONTEXT, GateError

ISOLATED = "isolated"


def llama_configs() -> dict:
    """The Llama configs a model context can be built from (megart.models.llama_config.CONFIGS)."""
    return dict(CONFIGS)


def known() -> list[str]:
    """Model context names (llama_<config>)."""
    return [f"llama_{k}" for k in CONFIGS]


def unknown(name: str, why: str) -> GateError:
    avail = ", ".join([ISOLATED] + known())
    return GateError(UNKNOWN_CONTEXT, f"--context {name!r}: {why}. Available contexts: {avail}.")
