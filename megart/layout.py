"""Plain-data layouts shared by host and device, declared once here.

Codegen turns these tables into `megart_layout.h` (constexpr indices); the host packs and reads
buffers with the same tables. Changing a layout here changes both sides together.
"""
from __future__ import annotations

# --- task descriptor: a fixed-size record per task instance --------------------------------------
MAX_WAITS = 4          # events one instance may wait on
MAX_SIGNALS = 4        # events one instance may signal
PARAM_WORDS = 24       # 8-byte parameter slots per instance (qkv_rope_append_fp8 needs 24)

# int32 header fields, in order; wait_event[i]/wait_count[i]/signal_event[i] are arrays.
HEADER_FIELDS = (
    ("type", 1),
    ("instance", 1),
    ("n_wait", 1),
    ("n_signal", 1),
    ("flags", 1),
    ("queue_pos", 1),
    ("wait_event", MAX_WAITS),
    ("wait_count", MAX_WAITS),
    ("signal_event", MAX_SIGNALS),
)
HEADER_INTS = sum(n for _, n in HEADER_FIELDS)
assert HEADER_INTS <= 20
HEADER_INTS = 20                      # padded so params start 16-byte aligned at byte 80
DESC_WORDS = HEADER_INTS // 2 + PARAM_WORDS   # descriptor size in 8-byte words
DESC_BYTES = DESC_WORDS * 8


def header_offsets() -> dict[str, int]:
    """int32 index of each header field."""
    out, pos = {}, 0
    for name, n in HEADER_FIELDS:
        out[name] = pos
        pos += n
    return out


# descriptor flags
FLAG_SIGNAL_FIRST = 1  # signal before waiting (grid barrier arrival)

# --- tagged words (megart/tagged.py): a bf16 value in the low 16 bits, the step's tag in the high 16 ---------
# A reader polls until every word it needs carries this step's tag, so it needs no event wait. The tag of
# step g (the launch's generation, from 1) is TAG_MARK | (g & TAG_MASK): consecutive steps differ, and a
# zeroed word (a fresh buffer, or one reset after an abort) never matches.
TAG_MARK = 0x8000
TAG_MASK = 0x7FFF
HANG_POLL = -2001      # hang record event of a polled read that never saw its tag (have/need: the tags)


def step_tag(gen: int) -> int:
    """The 16-bit tag the words written in step `gen` carry."""
    return TAG_MARK | (int(gen) & TAG_MASK)


# --- control block: int64 words the kernel and host share ------------------------------------------
CTRL_FIELDS = (
    "step",          # last completed step (generation); a launch runs step+1
    "done",          # monotonic count of workers that finished, nw per step
    "abort",         # nonzero once a watchdog fired; every spinner checks it
    "hang_worker",
    "hang_queue_pos",
    "hang_type",
    "hang_event",
    "hang_have",
    "hang_need",
    "hang_instance",
    "span_base",     # first step recorded into the span buffer
    "span_cap",      # number of steps the span buffer holds
    "span_overflow", # records dropped because their step was past the buffer
    "abort_time",
)
CTRL_WORDS = 16
assert len(CTRL_FIELDS) <= CTRL_WORDS
CTRL = {name: i for i, name in enumerate(CTRL_FIELDS)}

# --- tensor-parallel builds only (MEGART_TP): peer events in descriptors, peers' counters in ctrl ----
# A signal word < 0 counts event e up on rank q: word = -1 - (e | q << PEER_RANK_SHIFT). A wait word < 0
# waits on peer event e = -1 - word at system scope. ctrl[CTRL_WORDS + q] holds the address, mapped
# here, of rank q's event counters. Default kernels never see a negative word.
PEER_RANK_SHIFT = 24
MAX_PEER_EVENTS = 1 << PEER_RANK_SHIFT


def peer_signal_word(event: int, rank: int) -> int:
    return -1 - (event | rank << PEER_RANK_SHIFT)


def peer_wait_word(event: int) -> int:
    return -1 - event


# --- span record: int64 words per executed instance ------------------------------------------------
SPAN_FIELDS = ("type_id", "instance", "worker", "smid", "wait_start", "body_begin", "body_end", "step",
               "mark0", "mark1")   # mark0/1: the body's phase marks (megart::span_mark; body_begin if unmarked)
SPAN_WORDS = len(SPAN_FIELDS)
# MEGART_STREAM_WAITS builds put two counters in each mark word instead: the second at this bit
# (csrc/weight_stream.cuh adds them, megart.profile.stream_wait_parts splits them)
MARK_HIGH_SHIFT = 32
SPAN = {name: i for i, name in enumerate(SPAN_FIELDS)}


def layout_header() -> str:
    """C++ text of the plain-data layout header (no logic)."""
    lines = [
        "// Generated from megart/layout.py. Do not edit: change the Python table instead.",
        "#pragma once",
        "namespace megart {",
        f"constexpr int kMaxWaits = {MAX_WAITS};",
        f"constexpr int kMaxSignals = {MAX_SIGNALS};",
        f"constexpr int kParamWords = {PARAM_WORDS};",
        f"constexpr int kHeaderInts = {HEADER_INTS};",
        f"constexpr int kDescWords = {DESC_WORDS};",
        f"constexpr int kFlagSignalFirst = {FLAG_SIGNAL_FIRST};",
        f"constexpr int kSpanWords = {SPAN_WORDS};",
        f"constexpr int kMarkHighShift = {MARK_HIGH_SHIFT};",
        f"constexpr int kCtrlWords = {CTRL_WORDS};",
        f"constexpr int kPeerRankShift = {PEER_RANK_SHIFT};",
        f"constexpr unsigned kTagMark = {TAG_MARK:#x}u;",
        f"constexpr unsigned kTagMask = {TAG_MASK:#x}u;",
        f"constexpr int kHangPoll = {HANG_POLL};",
    ]
    for name, idx in header_offsets().items():
        lines.append(f"constexpr int kHdr_{name} = {idx};")
    for name, idx in CTRL.items():
        lines.append(f"constexpr int kCtrl_{name} = {idx};")
    for name, idx in SPAN.items():
        lines.append(f"constexpr int kSpan_{name} = {idx};")
    lines += [
        "struct alignas(16) TaskDesc {",
        "  int hdr[kHeaderInts];",
        "  unsigned long long params[kParamWords];",
        "};",
        f"static_assert(sizeof(TaskDesc) == {DESC_BYTES}, \"descriptor size drifted from layout.py\");",
        "}  // namespace megart",
    ]
    return "\n".join(lines) + "\n"
