"""The faithful per-task gate: measure one task type INSIDE a persistent megakernel at the production
grid (slowCTA / wall / sumCTA from the in-kernel profiler, matched by numeric task id), after a
cosine >= 0.99 correctness check against PyTorch at decode geometry; compare a candidate body with
the in-tree one (WIN / NULL / REGRESS / SLOUGHING). See docs/FAITHFUL.md.

    python -m megart.faithful --task gemv_m1 --shape 8192x2048 --num-workers 132 --baseline --json base.jsonl
    python -m megart.faithful --task gemv_m1 --kernel my_gemv.cuh --json cand.jsonl
    python -m megart.faithful compare base.jsonl cand.jsonl
"""
from .codes import GateError
from .compare import judge
from .gates import GateInputs, GateSpec, register_gate

__all__ = ["GateError", "GateSpec", "GateInputs", "register_gate", "judge", "main"]


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
