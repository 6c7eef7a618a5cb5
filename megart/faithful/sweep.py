"""--sweep-workers: the three metrics against the worker count (the best kernel flips with the grid:
GEMV-style bodies win at high occupancy, MMA-style ones at low nw), as a table and a PNG."""
from __future__ import annotations

from pathlib import Path

LABELS = (("slow_cta", "slowCTA"), ("wall", "wall"), ("sum_cta", "sumCTA"))


def sweep_table(results: list[dict]) -> str:
    lines = [f"{'shape':>14s} {'nw':>5s} {'tiles':>6s} {'slowCTA us':>11s} {'wall us':>9s} {'sumCTA us':>10s} "
             f"{'x floor':>8s}"]
    for r in sorted(results, key=lambda r: (r["shape"], r["nw"])):
        t = r["timings"]
        xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else "-"
        lines.append(f"{r['shape']:>14s} {r['nw']:5d} {r['tiles']:6d} {t['slow_cta']['median'] / 1e3:11.3f} "
                     f"{t['wall']['median'] / 1e3:9.3f} {t['sum_cta']['median'] / 1e3:10.3f} {xf:>8s}")
    return "\n".join(lines)


def tick_rows(ticks: list[int], min_gap: float = 0.1) -> list[int]:
    """The text line of each tick label, for worker counts that may sit close together (64 and 68, 128
    and 132): a label closer than `min_gap` of the axis span to the previous one on its line moves down."""
    span = max(1, max(ticks) - min(ticks))
    last: list[float] = []              # the last tick placed on each line
    rows = []
    for t in ticks:
        row = next((i for i, x in enumerate(last) if t - x >= min_gap * span), len(last))
        if row == len(last):
            last.append(t)
        last[row] = t
        rows.append(row)
    return rows


def plot_sweep(results: list[dict], path: str | Path) -> Path | None:
    """Median with min-max bars of slowCTA, wall, sumCTA against nw. None if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rs = sorted(results, key=lambda r: r["nw"])
    shapes = list(dict.fromkeys(r["shape"] for r in rs))
    fig = Figure(figsize=(13, 4), dpi=100)
    FigureCanvasAgg(fig)
    for i, (key, lab) in enumerate(LABELS):
        ax = fig.add_subplot(1, 3, i + 1)
        for shape in shapes:
            sr = [r for r in rs if r["shape"] == shape]
            nws = [r["nw"] for r in sr]
            med = [r["timings"][key]["median"] / 1e3 for r in sr]
            lo = [m - r["timings"][key]["min"] / 1e3 for m, r in zip(med, sr)]
            hi = [r["timings"][key]["max"] / 1e3 - m for m, r in zip(med, sr)]
            ax.errorbar(nws, med, yerr=[lo, hi], marker="o", capsize=3, label=shape)
        ax.set_xlabel("workers (nw)")
        ax.set_ylabel(f"{lab} (us, median, min-max)")
        ax.set_title(lab)
        ticks = sorted({r["nw"] for r in rs})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=8)
        for tick, row in zip(ax.xaxis.get_major_ticks(), tick_rows(ticks)):
            tick.set_pad(3.5 + 11 * row)            # close labels go on a lower line
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if len(shapes) > 1:
            ax.legend(fontsize=8)
    r0 = rs[0]
    fig.suptitle(f"faithful sweep: {r0['task']} {', '.join(shapes)} [{r0['context']}] {r0['kernel']} "
                 f"(sha {r0['kernel_sha']})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
