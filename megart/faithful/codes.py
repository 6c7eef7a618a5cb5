"""Exit codes of `python -m megart.faithful` and the one error type the gate raises.

Every failure the user can cause maps to its own code, so a script (or a broker) can tell "your
candidate does not compile" from "the GPU is busy" without parsing text. The table is documented
in docs/FAITHFUL.md; keep the two in step.
"""
from __future__ import annotations

OK = 0
INTERNAL = 1          # a bug in megart: the message says how to get the traceback
USAGE = 2             # bad flags / malformed --shape / unreadable file (argparse uses 2 too)
UNKNOWN_TASK = 3      # --task is not a registered task type with a gate spec
BAD_SHAPE = 4         # the task refuses the shape (or the mode, e.g. --decode-m1)
COMPILE = 5           # NVRTC rejected the kernel (the candidate); the log is printed
RESIDENCY = 6         # --num-workers exceeds what can be co-resident
NO_GPU = 7            # timing was asked (--iters, --require-gpu) but there is no usable CUDA device
INCORRECT = 8         # cosine < 0.99 vs the PyTorch reference (or non-finite output): no timing
LOCKED = 9            # another gate run holds the GPU lock past --lock-timeout
DEVICE = 10           # watchdog hang or a device error while running
UNKNOWN_CONTEXT = 11  # --context names no model, or the model module is not available
COMPARE_INPUT = 12    # compare: unreadable/malformed JSONL, or no (task, shape, nw, context) in common
NO_TIMINGS = 13       # compare: a side holds emulated (CPU) results, which carry no timings

TABLE = [
    (OK, "success (on a machine without a GPU: compiled, verified and emulated; timing skipped)"),
    (INTERNAL, "internal error in megart (set MEGART_FAITHFUL_DEBUG=1 for the traceback)"),
    (USAGE, "bad command line: unknown flag, malformed --shape/--sweep-workers, unreadable file"),
    (UNKNOWN_TASK, "unknown task, or a task type with no gate spec"),
    (BAD_SHAPE, "the task refuses the shape or mode (e.g. --decode-m1 on a task without that mode)"),
    (COMPILE, "the kernel (usually the candidate) failed to compile; the NVRTC log is printed"),
    (RESIDENCY, "--num-workers exceeds co-residency (CTAs per SM x SMs)"),
    (NO_GPU, "timing was asked (--iters, --require-gpu) but no GPU is usable"),
    (INCORRECT, "correctness failed: cosine < 0.99 vs the PyTorch reference, or non-finite output"),
    (LOCKED, "another gate run held the GPU lock for longer than --lock-timeout"),
    (DEVICE, "the kernel hung (watchdog) or the device failed during the run"),
    (UNKNOWN_CONTEXT, "--context names no known model, or that model is not available"),
    (COMPARE_INPUT, "compare: unreadable or malformed JSONL, or nothing in common to compare"),
    (NO_TIMINGS, "compare: a side holds emulated (CPU) results, which have no timings to compare"),
]


class GateError(Exception):
    """A failure with a user-facing one-paragraph message and its exit code."""

    def __init__(self, code: int, message: str, detail: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail      # e.g. the NVRTC log, printed after the paragraph


def table_text() -> str:
    return "\n".join(f"  {c:>2}  {m}" for c, m in TABLE)
