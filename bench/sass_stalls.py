"""Where the megakernel's warps stall, per SASS instruction, from Nsight Compute's source page.

    scripts/ncu_stalls.sh 1b_fp8_all 4          # on the GPU: ncu over a few decode steps, CSV to $OUT
    PYTHONPATH=. python bench/sass_stalls.py out/1b_fp8_all_sass.csv [--around F2FP.F16.E4M3] [--top 25]

The CSV is `ncu -i REPORT --page source --csv --print-source sass` of a report taken with the SourceCounters
section. Its "Warp Stall Sampling (All Samples)" column counts, per instruction, the samples in which a warp
sat there, and the stall_* columns say why (selected = issuing; long_sb = waiting on a global or generic
load; short_sb = on shared memory or a conversion; wait = a fixed dependency; barrier = a CTA barrier).
Three tables: the stall reasons over the whole kernel, the opcodes that collect the most samples (with
their top reasons), and the hottest instructions. --around OPCODE also sums the samples of each code
region around that opcode's clusters (e.g. the fp8 dot loops around F2FP.F16.E4M3), to tell a loop that
issues from one that waits. --reason R (e.g. no_inst: a warp waiting for its next instruction to be
fetched, an instruction-cache miss) lists the code windows and instructions where that reason's samples
fall. The first line also gives the code the run executed (instructions executed at least once, 16 bytes
each), the footprint that has to fit the SM's instruction caches. The samples cover every warp, the
producer warps' polls included.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instr:
    address: int
    source: str
    samples: int
    executed: int
    stalls: Counter = field(default_factory=Counter)

    @property
    def opcode(self) -> str:
        """The opcode with its modifiers, without a guard predicate (@P0, @!UP1)."""
        text = re.sub(r"^@!?U?P\w+\s+", "", self.source.strip())
        return text.split(" ")[0].rstrip(";")


def read(path: str) -> list[Instr]:
    """The instructions of the CSV's (first) kernel, in address order. Raises ValueError when the file is
    not an ncu source page with stall sampling (the columns are named in the message)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None:
        raise ValueError(f"{path}: no header row with 'Address' and 'Source' (expected `ncu -i REPORT --page source "
                         "--csv --print-source sass`)")
    cols = {name: i for i, name in enumerate(rows[head])}
    if SAMPLES not in cols:
        raise ValueError(f"{path}: no '{SAMPLES}' column: take the report with --section SourceCounters")
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(cols) or not r[cols["Address"]].startswith("0x"):
            continue

        def num(name):
            v = r[cols[name]] if name in cols else ""
            return int(v) if v.strip().lstrip("-").isdigit() else 0
        out.append(Instr(int(r[cols["Address"]], 16), r[cols["Source"]], num(SAMPLES), num(EXECUTED),
                         Counter({c[len("stall_"):]: num(c) for c in reasons if num(c)})))
    out.sort(key=lambda i: i.address)
    return out


def reasons(instrs: list[Instr]) -> Counter:
    total = Counter()
    for i in instrs:
        total.update(i.stalls)
    return total


def by_opcode(instrs: list[Instr]) -> dict[str, tuple[int, Counter]]:
    out: dict[str, tuple[int, Counter]] = {}
    for i in instrs:
        n, c = out.get(i.opcode, (0, Counter()))
        c = c + i.stalls
        out[i.opcode] = (n + i.samples, c)
    return out


def regions(instrs: list[Instr], opcode: str, gap: int = 0x400, pad: int = 60) -> list[dict]:
    """Clusters of `opcode` (consecutive hits less than `gap` bytes apart), each widened by `pad`
    instructions on both sides: their samples, executions and stall reasons."""
    hits = [k for k, i in enumerate(instrs) if i.opcode.startswith(opcode)]
    clusters: list[list[int]] = []
    for k in hits:
        if clusters and instrs[k].address - instrs[clusters[-1][-1]].address < gap:
            clusters[-1].append(k)
        else:
            clusters.append([k])
    base = instrs[0].address if instrs else 0
    out = []
    for c in clusters:
        lo, hi = max(c[0] - pad, 0), min(c[-1] + pad, len(instrs) - 1)
        seg = instrs[lo:hi + 1]
        out.append(dict(start=instrs[lo].address - base, end=instrs[hi].address - base, hits=len(c),
                        samples=sum(i.samples for i in seg), executed=max(i.executed for i in seg),
                        stalls=reasons(seg)))
    return out


def footprint(instrs: list[Instr]) -> tuple[int, int]:
    """(instructions executed at least once, bytes of code they span at 16 bytes each)."""
    n = sum(1 for i in instrs if i.executed > 0)
    return n, 16 * n


def windows(instrs: list[Instr], reason: str, size: int = 0x1000) -> list[tuple[int, int, int]]:
    """The samples of one stall reason summed over code windows of `size` bytes from the kernel's start:
    (window start, that reason's samples, all samples), windows with none of that reason left out, most first."""
    base = instrs[0].address if instrs else 0
    acc: dict[int, list[int]] = {}
    for i in instrs:
        w = (i.address - base) // size * size
        a = acc.setdefault(w, [0, 0])
        a[0] += i.stalls.get(reason, 0)
        a[1] += i.samples
    return sorted(((w, r, t) for w, (r, t) in acc.items() if r), key=lambda x: -x[1])


def _top(c: Counter, n: int = 3) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.most_common(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25, help="rows of the opcode and instruction tables")
    ap.add_argument("--around", default=None, help="sum the code regions around this opcode's clusters")
    ap.add_argument("--reason", default=None,
                    help="where one stall reason's samples fall (code windows, instructions), e.g. no_inst")
    args = ap.parse_args(argv)
    try:
        instrs = read(args.csv)
    except (OSError, ValueError) as e:
        print(f"sass_stalls: {e}", file=sys.stderr)
        return 2
    total = sum(i.samples for i in instrs)
    if not total:
        print(f"sass_stalls: {args.csv}: no stall samples (was the report taken with --section SourceCounters?)",
              file=sys.stderr)
        return 2
    n_exec, code = footprint(instrs)
    print(f"{len(instrs)} instructions, {total} samples; executed: {n_exec} instructions ({code / 1024:.1f} KB of code)")
    print("\nstall reason           samples      %")
    for k, v in reasons(instrs).most_common():
        print(f"  {k:20s} {v:8d} {100 * v / total:6.1f}")
    print("\nopcode                         samples      %  top reasons")
    ops = sorted(by_opcode(instrs).items(), key=lambda kv: -kv[1][0])
    for op, (n, c) in ops[:args.top]:
        print(f"  {op:28s} {n:8d} {100 * n / total:6.1f}  {_top(c)}")
    print("\nhottest instructions (offset from the kernel's start)")
    base = instrs[0].address
    for i in sorted(instrs, key=lambda i: -i.samples)[:args.top]:
        print(f"  {i.address - base:#8x} {i.samples:7d}  {i.source.strip()[:56]:56s} {_top(i.stalls)}")
    if args.around:
        print(f"\nregions around {args.around}")
        for r in regions(instrs, args.around):
            print(f"  {r['start']:#8x}-{r['end']:#8x} {r['hits']:3d} hits {r['samples']:7d} samples "
                  f"({100 * r['samples'] / total:4.1f}%), executed {r['executed']}: {_top(r['stalls'], 5)}")
    if args.reason:
        by = reasons(instrs).get(args.reason, 0)
        print(f"\nwhere {args.reason} falls ({by} samples, {100 * by / total:.1f}%): 4 KB code windows")
        for w, r, t in windows(instrs, args.reason)[:args.top]:
            print(f"  {w:#8x} {r:7d} of {t:7d} samples")
        print("instructions")
        hot = sorted((i for i in instrs if i.stalls.get(args.reason)), key=lambda i: -i.stalls[args.reason])
        for i in hot[:args.top]:
            print(f"  {i.address - base:#8x} {i.stalls[args.reason]:7d}  {i.source.strip()[:56]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
