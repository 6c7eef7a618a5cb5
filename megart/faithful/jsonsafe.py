"""Strict JSON for result lines: NaN and infinities are not JSON (strict parsers reject a bare NaN),
so each non-finite float becomes null, and the record says which fields were nulled and why."""
from __future__ import annotations

import json
import math


def _word(v: float) -> str:
    return "nan" if math.isnan(v) else "+inf" if v > 0 else "-inf"


def strict(rec: dict) -> dict:
    """A copy of `rec` with every non-finite float (at any depth) replaced by None, plus
    rec["nonfinite"] = {"dotted.path": "nan" | "+inf" | "-inf"} when there were any."""
    found = {}

    def walk(v, path):
        if isinstance(v, float) and not math.isfinite(v):
            found[path] = _word(v)
            return None
        if isinstance(v, dict):
            return {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    out = walk(rec, "")
    if found:
        out["nonfinite"] = {**(out.get("nonfinite") or {}), **found}
    return out


def dumps(rec: dict) -> str:
    """One strict JSON line (sorted keys); raises ValueError rather than ever writing NaN."""
    return json.dumps(strict(rec), sort_keys=True, allow_nan=False)
