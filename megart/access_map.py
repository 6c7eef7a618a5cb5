"""Byte-range access history of one storage allocation, for dependency inference (graph.py).

The accessed bytes are kept as disjoint segments sorted by address. Each segment remembers its last
writer and the readers since that write. An access finds the segments it overlaps by bisection, so
a call of n disjoint tiles costs O(n log n), not O(n^2) as a scan of every earlier access would.

A read depends on the last writer of every byte it reads; a write also depends on the readers since
that writer. Earlier writers and readers need no edge of their own: the last writer already depends on
them, so the order is implied transitively.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

NO_WRITER = -1


class AccessMap:
    def __init__(self):
        self.lo: list[int] = []        # segment starts, sorted
        self.hi: list[int] = []        # segment ends (exclusive); segments never overlap
        self.writer: list[int] = []    # last writer's uid, or NO_WRITER
        self.readers: list[list] = []  # uids that read the segment since its last write

    def access(self, lo: int, hi: int, uid: int, reads: bool, writes: bool) -> set:
        """Record one access of bytes [lo, hi) by instance `uid`; return the uids it must follow."""
        if hi <= lo:
            return set()
        i, j = self._split_span(lo, hi)
        deps = set()
        for k in range(i, j):
            if self.writer[k] != NO_WRITER:
                deps.add(self.writer[k])
            if writes:
                deps.update(self.readers[k])
        if writes:
            self._replace(i, j, lo, hi, uid)
        else:
            self._add_reader(i, j, lo, hi, uid)
        deps.discard(uid)
        return deps

    def writers(self, lo: int, hi: int) -> tuple[set, bool]:
        """The last writers of bytes [lo, hi), and whether some byte there has none (nothing recorded)."""
        found, at = set(), lo
        for k in range(max(0, bisect_right(self.lo, lo) - 1), len(self.lo)):
            if self.lo[k] >= hi:
                break
            if self.hi[k] <= lo:
                continue
            if self.lo[k] > at or self.writer[k] == NO_WRITER:
                return found, True
            found.add(self.writer[k])
            at = self.hi[k]
        return found, at < hi

    # --- segment surgery ---------------------------------------------------------------------------
    def _split_at(self, x: int) -> None:
        """Make x a segment boundary if it falls strictly inside a segment."""
        k = bisect_right(self.lo, x) - 1
        if k >= 0 and self.lo[k] < x < self.hi[k]:
            self.lo.insert(k + 1, x)
            self.hi.insert(k + 1, self.hi[k])
            self.hi[k] = x
            self.writer.insert(k + 1, self.writer[k])
            self.readers.insert(k + 1, list(self.readers[k]))

    def _split_span(self, lo: int, hi: int) -> tuple[int, int]:
        """Split the segments at lo and hi; return the index range of the segments inside [lo, hi)."""
        self._split_at(lo)
        self._split_at(hi)
        return bisect_left(self.lo, lo), bisect_left(self.lo, hi)

    def _replace(self, i: int, j: int, lo: int, hi: int, uid: int) -> None:
        self.lo[i:j], self.hi[i:j] = [lo], [hi]
        self.writer[i:j], self.readers[i:j] = [uid], [[]]

    def _add_reader(self, i: int, j: int, lo: int, hi: int, uid: int) -> None:
        """Append uid to the segments in [lo, hi) and cover the gaps between them with new segments."""
        lo_s, hi_s, wr, rd = [], [], [], []
        at = lo
        for k in range(i, j):
            if self.lo[k] > at:                       # a gap nobody touched yet
                lo_s.append(at), hi_s.append(self.lo[k]), wr.append(NO_WRITER), rd.append([uid])
            self.readers[k].append(uid)
            lo_s.append(self.lo[k]), hi_s.append(self.hi[k]), wr.append(self.writer[k]), rd.append(self.readers[k])
            at = self.hi[k]
        if at < hi:
            lo_s.append(at), hi_s.append(hi), wr.append(NO_WRITER), rd.append([uid])
        self.lo[i:j], self.hi[i:j], self.writer[i:j], self.readers[i:j] = lo_s, hi_s, wr, rd
