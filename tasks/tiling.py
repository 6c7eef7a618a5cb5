"""Small helpers task declarations share to cut work into instances."""
from __future__ import annotations

from ..errors import GraphError
from ..tensors import as_ref


def even_tiles(n: int, tiles: int, align: int = 1, rotate: int = 0) -> list[tuple[int, int]]:
    """Split [0, n) into at most `tiles` contiguous non-empty ranges whose starts are multiples of
    `align` and whose sizes differ by at most `align`. The ranges one unit larger are those from range
    `rotate` on (cyclically), so calls that rotate it spread the larger ranges over different instances."""
    if tiles < 1:
        raise GraphError(f"tiles must be >= 1, got {tiles}")
    units = -(-n // align)
    tiles = min(tiles, units)
    out, lo_unit = [], 0
    for i in range(tiles):
        hi_unit = lo_unit + units // tiles + (1 if (i - rotate) % tiles < units % tiles else 0)
        out.append((lo_unit * align, min(hi_unit * align, n)))
        lo_unit = hi_unit
    return out


def require(cond: bool, task: str, message: str) -> None:
    """Refuse a shape or argument a task body cannot handle, at graph-build time."""
    if not cond:
        raise GraphError(f"{task}: {message}")


def pos_stamp_ref(task: str, pos_stamp):
    """pos_advance's stamp (pos_advance writes it, attention_decode's weight-stream producer polls it), as a ref:
    one tagged word; None when not given."""
    if pos_stamp is None:
        return None
    r = as_ref(pos_stamp, "pos_stamp")
    require(r.tensor.tagged and r.count == 1, task, "pos_stamp must be one tagged word (megart.tagged.empty(1))")
    return r


def round_rows(n: int, tiles: int, width: int, rotate: int = 0) -> list[dict]:
    """Deal rows [0, n) to `tiles` instances in rounds: round j gives instance i rows [j*width*T + i*width, +width)
    (T = the instance count), as many whole rounds as fit; the rows left after them are dealt as contiguous tiles
    (even_tiles, `rotate` as there). An instance whose compute warps walk its rows in order (warp w takes rows w,
    w + width, ... at width = the warp count) then finishes [0, n) front to back with every other instance, so
    a consumer that reads the output in pieces finds its first pieces complete long before the call ends.
    Each dict: `n` (the instance's rows), its row map (row_first, row_stride, row_full, row_tail, row_width: local
    row g < row_full is (g // width) * row_stride + row_first + g % width, later ones row_tail + g - row_full)
    and `ranges`, the [lo, hi) row ranges it covers (map_ranges)."""
    if width < 1:
        raise GraphError(f"the round width must be >= 1, got {width}")
    tiles = max(1, min(tiles, n))
    rounds = n // (width * tiles)
    stride = width * tiles
    done = rounds * stride
    tails = even_tiles(n - done, tiles, rotate=rotate) if n > done else []
    out = []
    for i in range(tiles):
        lo, hi = tails[i] if i < len(tails) else (0, 0)
        if rounds or hi > lo:
            d = dict(n=rounds * width + hi - lo, row_first=i * width, row_stride=stride, row_full=rounds * width,
                     row_tail=done + lo, row_width=width)
            out.append({**d, "ranges": map_ranges(d)})
    return out


def map_ranges(m) -> list[tuple[int, int]]:
    """The [lo, hi) row ranges of a row map (round_rows' keys: n, row_first, row_stride, row_full, row_tail,
    row_width): one per whole round, then the tail; a map with no rounds is [row_tail, row_tail + n)."""
    w, full, first, stride = m["row_width"], m["row_full"], m["row_first"], m["row_stride"]
    ranges = [(j * stride + first, j * stride + first + w) for j in range(full // w)] if full else []
    if m["n"] > full:
        ranges.append((m["row_tail"], m["row_tail"] + m["n"] - full))
    return ranges
