"""The per-task correctness gate: a result against the PyTorch reference on the live elements (cosine >=
COS_MIN, relative error reported). Shared by the GPU and CPU paths and the host-simulated body check."""
from __future__ import annotations

import torch

from ..nvtx_ranges import ranged
from .gate_spec import GateInputs

COS_MIN = 0.99


def result_of(gi: GateInputs, tensors: dict) -> torch.Tensor:
    """The checked quantity from the output tensors ({name: tensor}, device or host copies)."""
    return gi.result(tensors) if gi.result is not None else tensors[gi.output]


@ranged("faithful.check_output")
def check_output(got: torch.Tensor, gi: GateInputs) -> dict:
    exp = gi.expected.detach().to("cpu", torch.float64)
    g = got.detach().to("cpu").to(torch.float64).reshape(exp.shape)
    if gi.live is not None:
        exp, g = gi.live(exp), gi.live(g)
    g, exp = g.reshape(-1), exp.reshape(-1)
    finite = bool(torch.isfinite(g).all())
    ne, ng = float(exp.norm()), float(g.norm())
    if ne == 0 and ng == 0:
        cos = 1.0
    elif ne == 0 or ng == 0 or not finite:
        cos = 0.0 if finite else float("nan")
    else:
        cos = float(torch.dot(g, exp) / (ng * ne))
    rel = float((g - exp).norm() / max(ne, 1e-300)) if finite else float("nan")
    ok = finite and cos >= COS_MIN
    return {"cos": cos, "rel_err": rel, "max_abs_err": float((g - exp).abs().max()) if finite else float("nan"),
            "live": gi.live_desc, "elements": int(g.numel()), "finite": finite, "threshold": COS_MIN, "pass": ok}
