"""On a CPU, run the candidate's CUDA body itself where megart can: the bodies of the task types declared
with hostsim=True compile for the host (megart.emulate.hostsim: one CTA as fibers). The emulator alone runs each task's
Python reference, so without this a wrong body that compiles would look like a pass."""
from __future__ import annotations

import os
import shutil


def _unchecked(why: str) -> dict:
    return {"body_checked": False, "body_why": why}


def check_body(p, b, say) -> dict:
    """Run built-and-compiled gate kernel `b` (CPU device) through the host simulation. Returns
    {"body_checked": bool, "body_why": str, "body_correctness": dict (when checked)}."""
    from ..errors import MegartError
    from ..emulate import hostsim
    from .correctness import check_output, result_of
    if not p.ttype.hostsim:
        return _unchecked(f"the host simulation runs the bodies of task types declared with hostsim=True; "
                          f"{p.ttype.name!r} is not one")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return _unchecked(f"no host C++ compiler ({cxx!r} not found) for the host simulation")
    say("running the candidate's CUDA body in the host simulation (g++, one CTA as fibers) ...")
    try:
        out = hostsim.run(b.pk, seed=p.cfg.seed)
    except MegartError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _unchecked(f"the host simulation could not run the body: {first}")
    corr = check_output(result_of(b.inputs, out), b.inputs)
    corr["where"] = "cpu host simulation of the CUDA body"
    return {"body_checked": True, "body_why": "ran through megart.emulate.hostsim", "body_correctness": corr}
