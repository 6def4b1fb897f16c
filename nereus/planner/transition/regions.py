"""Region maths: hyper-rectangles ("boxes") in a tensor's global index space.

A box is ``(offsets, lengths)``, like DCP's ``ReadItem``. These are small pure functions; the
transition planner builds everything else on them. Boxes of one tensor held under one layout
form a partition of the tensor (TP shards, then ZeRO row shards inside each TP shard), which is
what lets :class:`BoxIndex` find overlaps by bisection instead of comparing every pair.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Sequence

from nereus.planner.transition.types import Region

Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(lengths: Sequence[int]) -> int:
    """Number of elements of a box: ``volume((2, 3)) == 6``."""
    n = 1
    for x in lengths:
        n *= x
    return n


def intersect(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]) -> Box | None:
    """Intersection of two boxes, or None when it is empty.

    Example: rows [256, 512) x cols [0, 4096) (TP rank 1 of 4 of a [1024, 4096] weight) and rows
    [384, 640) x cols [0, 4096) intersect in rows [384, 512):
    ``intersect((256, 0), (256, 4096), (384, 0), (256, 4096)) == ((384, 0), (128, 4096))``.
    """
    offs, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def contains(outer_off: Sequence[int], outer_len: Sequence[int], inner_off: Sequence[int], inner_len: Sequence[int]) -> bool:
    """True when the inner box lies inside the outer one: rows [384, 512) lie inside [256, 512)."""
    return all(oo <= io and io + il <= oo + ol for oo, ol, io, il in zip(outer_off, outer_len, inner_off, inner_len))


def difference(off: Sequence[int], lens: Sequence[int], hole_off: Sequence[int], hole_len: Sequence[int]) -> tuple[Box, ...]:
    """``box minus hole`` as disjoint boxes (slab decomposition, at most 2 per dim).

    Example: rows [0, 8) minus rows [2, 5) of a 1-D tensor is rows [0, 2) and [5, 8):
    ``difference((0,), (8,), (2,), (3,)) == (((0,), (2,)), ((5,), (3,)))``. In 2-D, the slabs
    below and above the hole along dim 0 take the full width; the rest is cut along dim 1.
    """
    cut = intersect(off, lens, hole_off, hole_len)
    if cut is None:
        return ((tuple(off), tuple(lens)),)
    c_off, c_len = cut
    out: list[Box] = []
    cur_off, cur_len = list(off), list(lens)
    for d in range(len(off)):
        lo, hi = cur_off[d], cur_off[d] + cur_len[d]
        clo, chi = c_off[d], c_off[d] + c_len[d]
        if clo > lo:
            o, ln = list(cur_off), list(cur_len)
            ln[d] = clo - lo
            out.append((tuple(o), tuple(ln)))
        if chi < hi:
            o, ln = list(cur_off), list(cur_len)
            o[d], ln[d] = chi, hi - chi
            out.append((tuple(o), tuple(ln)))
        cur_off[d], cur_len[d] = clo, chi - clo
    return tuple(out)


def covers_exactly(off: Sequence[int], lens: Sequence[int], pieces: Iterable[Box]) -> bool:
    """True when ``pieces`` tile the box exactly once: each lies inside it, no two overlap, and
    their volumes add up to the box's. Example: rows [0, 4) and [4, 8) tile rows [0, 8); adding
    rows [3, 5) would cover rows 3-4 twice."""
    ps = list(pieces)
    if any(not contains(off, lens, po, pl) for po, pl in ps):
        return False
    if sum(volume(pl) for _, pl in ps) != volume(lens):
        return False
    ordered = sorted(ps)
    for i, (ao, al) in enumerate(ordered):
        for bo, bl in ordered[i + 1:]:
            if bo[0] >= ao[0] + al[0]:
                break  # sorted by dim-0 offset: no later piece can overlap this one
            if intersect(ao, al, bo, bl) is not None:
                return False
    return True


def region_intersection(a: Region, b: Region) -> Region | None:
    """Intersection of two regions of the same (model, tensor, kind); None when disjoint or
    of different tensors. The result keeps ``a``'s dtype."""
    if a.key != b.key:
        return None
    cut = intersect(a.offsets, a.lengths, b.offsets, b.lengths)
    if cut is None:
        return None
    return Region(a.model, a.tensor, a.kind, cut[0], cut[1], a.dtype)


class BoxIndex:
    """Finds the boxes of a partition that overlap a query box.

    Boxes are grouped by their extent in every dim but 0; inside a group they are disjoint
    intervals along dim 0, sorted, so a query bisects. A TP x ZeRO partition of a [rows, cols]
    tensor has at most ``tp`` groups, so a query costs O(tp log n) instead of O(n).
    Example: boxes rows [0, 2), [2, 4) of a [4, 8] tensor form one group (cols [0, 8)); the
    query rows [1, 3) hits both.
    """

    __slots__ = ("_groups",)

    def __init__(self, boxes: Iterable[Box]) -> None:
        groups: dict[tuple, list[tuple[int, int, Box]]] = {}
        for off, ln in boxes:
            rest = tuple(zip(off[1:], ln[1:]))
            groups.setdefault(rest, []).append((off[0], off[0] + ln[0], (off, ln)))
        self._groups = []
        for rest, items in groups.items():
            items.sort()
            self._groups.append((rest, [i[0] for i in items], items))

    def overlapping(self, off: Sequence[int], lens: Sequence[int]) -> list[Box]:
        """Boxes that intersect the query box, in a deterministic order."""
        out: list[Box] = []
        lo, hi = off[0], off[0] + lens[0]
        for rest, starts, items in self._groups:
            if any(ro >= qo + ql or qo >= ro + rl for (ro, rl), qo, ql in zip(rest, off[1:], lens[1:])):
                continue
            i = max(0, bisect_right(starts, lo) - 1)
            while i < len(items) and items[i][0] < hi:
                if items[i][1] > lo:
                    out.append(items[i][2])
                i += 1
        return out
