"""`python -m megart.faithful compare BASE.jsonl CAND.jsonl`: ratio and verdict per
(task, shape, nw, context), judged on slowCTA AND wall AND sumCTA together.

Noise band. Each result records, per metric, the per-step distribution over its profiled steps:
median, min, max, spread = (max - min) / median, and noise = (p90 - p10) / median (the step-to-step
spread without the most extreme 10% on each side, which one disturbed step cannot blow up). The
band of a metric is

    band = max(MIN_BAND, base noise, cand noise, 2 x timer tick / base median, cross-run spread)

where the cross-run spread is (max - min) / median of the per-run medians: of the repeats inside one
result (`run_spread`, --repeats), and of the results when a file holds several runs of the same key
(`--band spread` uses the full (max - min) / median instead of noise: wider, safer).
A ratio r = cand / base is *better* when r < 1 - band, *worse* when r > 1 + band, else *same*.

Verdict (first rule that applies):

* INVALID    either side has no timing, or the candidate failed correctness.
* SLOUGHING  slowCTA is better, but the work was only spread over more CTAs: sumCTA is worse, or the
             candidate ran on more CTAs per step and sumCTA is not better. Rejected.
* WIN        slowCTA better, and neither wall nor sumCTA worse.
* REGRESS    any of slowCTA, wall, sumCTA worse.
* NULL       none of the above: no change beyond the noise band.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .codes import COMPARE_INPUT, NO_TIMINGS, USAGE, GateError

METRICS = ("slow_cta", "wall", "sum_cta")
LABELS = {"slow_cta": "slowCTA", "wall": "wall", "sum_cta": "sumCTA"}
MIN_BAND = 0.01          # 1 %: below this, medians of the same kernel still move run to run
TIMER_TICK_NS = 32.0     # %globaltimer resolution on Hopper


def key_of(rec: dict) -> tuple:
    return (rec["task"], str(rec["shape"]), int(rec["nw"]), rec.get("context", "isolated"))


def key_str(key: tuple) -> str:
    return f"{key[0]} {key[1]} nw={key[2]} {key[3]}"


def load(path: str | Path) -> list[dict]:
    """Result records from a JSONL file. Lines may be bare JSON objects, `FAITHFUL_RESULT {...}` or
    `FAITHFUL_CPU {...}` (so a captured stdout log works too); other lines are ignored."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise GateError(COMPARE_INPUT, f"cannot read {p}: {exc}") from None
    recs = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        tag = next((t for t in ("FAITHFUL_RESULT ", "FAITHFUL_CPU ") if t in s), None)
        if tag:
            s = s.split(tag, 1)[1].strip()
        elif not s.startswith("{"):
            continue
        try:
            rec = json.loads(s)
        except ValueError as exc:
            raise GateError(COMPARE_INPUT, f"{p}:{n}: not valid JSON ({exc}): {s[:120]!r}") from None
        if not isinstance(rec, dict) or not {"task", "shape", "nw"} <= set(rec):
            raise GateError(COMPARE_INPUT, f"{p}:{n}: not a faithful result (needs task, shape, nw, context, "
                                           "timings): " + s[:120])
        rec["_src"] = f"{p.name}:{n}"
        recs.append(rec)
    if not recs:
        raise GateError(COMPARE_INPUT, f"{p} holds no faithful results (no JSON object or FAITHFUL_RESULT line).")
    return recs


@dataclass
class Side:
    """One file's runs of one key, reduced to a median per metric and a noise figure per metric."""
    runs: list
    median: dict = field(default_factory=dict)
    noise: dict = field(default_factory=dict)
    spread: dict = field(default_factory=dict)
    cross: dict = field(default_factory=dict)
    ctas: float | None = None
    tiles: int | None = None
    timed: bool = True
    correct: bool = True
    sha: str | None = None

    @classmethod
    def of(cls, runs: list[dict]) -> "Side":
        s = cls(runs=runs)
        s.correct = all((r.get("correctness") or {}).get("pass", True) for r in runs)
        timed = [r for r in runs if r.get("timings")]
        s.timed = bool(timed) and all(all(m in r["timings"] for m in METRICS) for r in timed)
        s.sha = runs[-1].get("kernel_sha")
        s.tiles = runs[-1].get("tiles")
        if not s.timed:
            return s
        for m in METRICS:
            meds = [float(r["timings"][m]["median"]) for r in timed]
            s.median[m] = statistics.median(meds)
            s.noise[m] = max(_noise(r["timings"][m]) for r in timed)
            s.spread[m] = max(float(r["timings"][m].get("spread") or 0.0) for r in timed)
            across = (max(meds) - min(meds)) / s.median[m] if len(meds) > 1 and s.median[m] > 0 else 0.0
            within = max(float(r["timings"][m].get("run_spread") or 0.0) for r in timed)
            s.cross[m] = max(across, within)
        ctas = [r.get("ctas_per_step") for r in timed if r.get("ctas_per_step") is not None]
        s.ctas = statistics.median(ctas) if ctas else None
        return s


def _noise(t: dict) -> float:
    v = t.get("noise")
    if v is None:                       # older records: fall back to the full spread
        v = t.get("spread")
    return float(v or 0.0)


@dataclass
class Verdict:
    key: tuple
    verdict: str
    reason: str
    ratio: dict = field(default_factory=dict)
    band: dict = field(default_factory=dict)
    move: dict = field(default_factory=dict)   # metric -> "better" | "worse" | "same"
    base_ctas: float | None = None
    cand_ctas: float | None = None
    base_tiles: int | None = None
    cand_tiles: int | None = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"task": self.key[0], "shape": self.key[1], "nw": self.key[2], "context": self.key[3],
                "verdict": self.verdict, "reason": self.reason, "ratio": self.ratio, "band": self.band,
                "move": self.move, "ctas": [self.base_ctas, self.cand_ctas],
                "tiles": [self.base_tiles, self.cand_tiles], "notes": self.notes}


def _pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def judge(key: tuple, base: Side, cand: Side, band_mode: str = "noise", min_band: float = MIN_BAND) -> Verdict:
    v = Verdict(key, "NULL", "", base_ctas=base.ctas, cand_ctas=cand.ctas, base_tiles=base.tiles,
                cand_tiles=cand.tiles)
    if not cand.correct:
        v.verdict, v.reason = "INVALID", "the candidate failed correctness (cosine < 0.99): never trade it for speed"
        return v
    if not base.timed or not cand.timed:
        side = "baseline" if not base.timed else "candidate"
        v.verdict, v.reason = "INVALID", f"the {side} has no timings (a CPU-only run?)"
        return v
    for m in METRICS:
        b, c = base.median[m], cand.median[m]
        if b <= 0:
            v.verdict, v.reason = "INVALID", f"baseline median {LABELS[m]} is {b} ns"
            return v
        r = c / b
        noise = (max(base.spread[m], cand.spread[m]) if band_mode == "spread"
                 else max(base.noise[m], cand.noise[m]))
        band = max(min_band, noise, 2 * TIMER_TICK_NS / b, base.cross[m], cand.cross[m])
        v.ratio[m], v.band[m] = r, band
        v.move[m] = "better" if r < 1 - band else "worse" if r > 1 + band else "same"
    mv, rt = v.move, v.ratio
    if base.sha and cand.sha and base.sha == cand.sha and base.tiles == cand.tiles:
        v.notes.append("baseline and candidate compiled the same source (same sha): any verdict but NULL is noise")
    more_ctas = base.ctas is not None and cand.ctas is not None and cand.ctas > base.ctas
    if mv["slow_cta"] == "better" and (mv["sum_cta"] == "worse" or (more_ctas and mv["sum_cta"] != "better")):
        why = (f"sumCTA rose {abs(rt['sum_cta'] - 1) * 100:.1f}%" if mv["sum_cta"] == "worse"
               else f"sumCTA did not fall ({_pct(rt['sum_cta'])}) while the task ran on "
                    f"{cand.ctas:g} CTAs per step instead of {base.ctas:g}")
        v.verdict = "SLOUGHING"
        v.reason = (f"slowCTA fell {abs(rt['slow_cta'] - 1) * 100:.1f}% only because the same work was spread over "
                    f"more CTAs: {why}. In the real megakernel those CTAs belong to co-resident tasks. Rejected.")
    elif mv["slow_cta"] == "better" and mv["wall"] != "worse" and mv["sum_cta"] != "worse":
        v.verdict = "WIN"
        v.reason = (f"slowCTA {_pct(rt['slow_cta'])}, wall {_pct(rt['wall'])}, sumCTA {_pct(rt['sum_cta'])} "
                    f"(bands ±{v.band['slow_cta'] * 100:.1f}/{v.band['wall'] * 100:.1f}/"
                    f"{v.band['sum_cta'] * 100:.1f}%)")
    elif "worse" in mv.values():
        worse = [f"{LABELS[m]} {_pct(rt[m])} (band ±{v.band[m] * 100:.1f}%)" for m in METRICS if mv[m] == "worse"]
        mixed = " although slowCTA improved" if mv["slow_cta"] == "better" else ""
        v.verdict = "REGRESS"
        v.reason = "worse beyond the noise band: " + ", ".join(worse) + mixed
    else:
        v.verdict = "NULL"
        v.reason = (f"slowCTA {_pct(rt['slow_cta'])} is inside the noise band ±{v.band['slow_cta'] * 100:.1f}%"
                    if mv["slow_cta"] == "same" else "no change beyond the noise band")
        moved = [f"{LABELS[m]} {_pct(rt[m])}" for m in ("wall", "sum_cta") if mv[m] == "better"]
        if moved:
            v.reason += "; improved but not the verdict metric: " + ", ".join(moved)
    return v


def _weights(rec: dict) -> str | None:
    """The weights' engine a record ran ("stream" / "registers"), where it says (records from before --engine
    do not)."""
    return (rec.get("engine") or {}).get("weights")


def is_emulated(rec: dict) -> bool:
    """A CPU-path record: marked emulated, or (older lines) untimed from the CPU emulator."""
    return bool(rec.get("emulated")) or (not rec.get("timings") and str(rec.get("device", "")).startswith("cpu"))


def check_band(min_band) -> None:
    """A NaN band makes every comparison false (so anything is NULL); an infinite or >= 1 band hides any
    change. Refuse them rather than judge."""
    if not isinstance(min_band, (int, float)) or not math.isfinite(min_band) or not 0 <= min_band < 1:
        raise GateError(USAGE, f"--min-band {min_band!r}: give a finite fraction in [0, 1), e.g. 0.01 for 1%.")


def compare(base_recs: list[dict], cand_recs: list[dict], band_mode: str = "noise",
            min_band: float = MIN_BAND) -> tuple[list[Verdict], list[str]]:
    """Verdicts for every key present on both sides, and notes on keys present on one side only."""
    check_band(min_band)
    def group(recs):
        g: dict = {}
        for r in recs:
            g.setdefault(key_of(r), []).append(r)
        return g

    gb, gc = group(base_recs), group(cand_recs)
    common = [k for k in gb if k in gc]
    notes = [f"only in baseline: {key_str(k)}" for k in gb if k not in gc]
    notes += [f"only in candidate: {key_str(k)}" for k in gc if k not in gb]
    if not common:
        raise GateError(COMPARE_INPUT, "the two files have no (task, shape, nw, context) in common, so nothing can "
                                       "be compared. Baseline has: " + "; ".join(key_str(k) for k in gb)
                        + ". Candidate has: " + "; ".join(key_str(k) for k in gc) + ".")
    emulated = [f"{key_str(k)} ({side})" for k in common for side, g in (("baseline", gb), ("candidate", gc))
                if any(is_emulated(r) for r in g[k])]
    if emulated:
        raise GateError(NO_TIMINGS, "emulated results have no timings, so there is nothing to compare: "
                                    + "; ".join(emulated) + ". They come from the CPU path (compile, verify, "
                                    "emulate); time both sides on a GPU, then compare.")
    out = []
    for k in common:
        v = judge(k, Side.of(gb[k]), Side.of(gc[k]), band_mode, min_band)
        fb = [r.get("floor_bw") for r in gb[k] + gc[k] if r.get("floor_bw")]
        if len(fb) > 1 and (max(fb) - min(fb)) / min(fb) > 0.05:
            v.notes.append(f"the read floor differs by {(max(fb) / min(fb) - 1) * 100:.0f}% between runs: "
                           "different machine or state; ratios from one session are safer")
        devs = {r.get("device") for r in gb[k] + gc[k] if r.get("device")}
        if len(devs) > 1:
            v.notes.append(f"results come from different devices: {sorted(devs)}")
        engines = [sorted({_weights(r) for r in g[k]} - {None}) for g in (gb, gc)]
        if engines[0] and engines[1] and engines[0] != engines[1]:
            v.notes.append(f"the weights' engines differ (baseline {'/'.join(engines[0])}, candidate "
                           f"{'/'.join(engines[1])}): a candidate's type is never on the weight stream, so this "
                           "compares it with what ships, engine included")
        out.append(v)
    return out, notes


def table(verdicts: list[Verdict]) -> str:
    head = ("task", "shape", "nw", "context", "slowCTA", "wall", "sumCTA", "band(slow)", "CTAs", "verdict")
    rows = []
    for v in verdicts:
        r = v.ratio
        ctas = (f"{v.base_ctas:g}->{v.cand_ctas:g}" if v.base_ctas is not None and v.cand_ctas is not None else "-")
        rows.append((v.key[0], v.key[1], str(v.key[2]), v.key[3],
                     *(f"{r[m]:.3f}" if m in r else "-" for m in METRICS),
                     f"±{v.band['slow_cta'] * 100:.1f}%" if "slow_cta" in v.band else "-", ctas, v.verdict))
    w = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(head)).rstrip()]
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.append("ratios are candidate / baseline medians (< 1 is faster)")
    for v in verdicts:
        lines.append(f"{v.verdict:9s} {key_str(v.key)}: {v.reason}")
        lines.extend(f"          note: {n}" for n in v.notes)
    return "\n".join(lines)
