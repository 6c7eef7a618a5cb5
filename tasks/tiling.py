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
