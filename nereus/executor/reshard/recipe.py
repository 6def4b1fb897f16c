"""One rank's bookkeeping of a transition plan, computed once per (plan, rank) and reused when the
same plan object is applied again (``recipe``).

What it holds is a function of the plan alone (the planner's frozen ``TransitionPlan``: the
same object gives the same answers): which ops touch this rank, each piece's peer, bytes, source
region and destination region, whether the pieces tile every new region (``cover_checked``), the
joins of neighbouring pieces per exchange (``joins``); and each piece's wire view as ``as_strided``
parameters over its region's tensor (``Geometry``), valid while the tensors keep the strides it
was computed for (checked on every use, recomputed otherwise). Only the tensors are new each
time (the store's old regions, the arena's new ones), so a transition applied again costs one
``as_strided`` per piece instead of the region math, lookups and checks that derived it.

Example: ``reserve_arena`` at start builds the recipe of the first transition, so that one runs
warm too; a transition back to a plan applied before (the same ``TransitionPlan`` object) reuses
its recipe. At most ``CACHE_SIZE`` recipes are kept per rank (least recently used dropped; a
process driving several ranks, as the threaded tests do, keeps that many for each), each holding
its plan so its id cannot be reused while cached."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from nereus.planner.transition.types import Region, TransitionPlan

CACHE_SIZE = 4
"""Recipes kept per rank: a job going back and forth between a few plans reuses each one's."""

_cache: OrderedDict[tuple[int, int], Recipe] = OrderedDict()
_lock = threading.Lock()


class Recipe:
    """This rank's plan-derived part of ``plan`` (see the module docstring)."""

    def __init__(self, plan: TransitionPlan, rank: int, major: dict[tuple[str, str], int]) -> None:
        self.plan = plan
        self.rank = rank
        self.major = dict(major)
        self.kept = {h.region for h in plan.kept if h.gpu == rank}
        self.dst = [h.region for h in plan.dst if h.gpu == rank]
        self.fresh = [r for r in self.dst if r not in self.kept]
        self.plan_rounds = plan.rounds  # a max over every op of the plan: taken once per recipe
        self.models = sorted({h.region.model for h in plan.dst})
        self.held = sorted(self.kept)
        """The kept regions, in order (those ``_NewLayout`` may relocate)."""
        self.ops: list[tuple] | None = None
        """Per op touching this rank, in (round, op id) order: (round, what, peer, bytes, piece,
        dim, source slot or -1, home index or -1): ``sources[slot]`` the held region the piece is
        read from (one slot per distinct source piece: its view is made once), ``fresh[home]``
        the new region it lands in. Built by the first ``_prepare``."""
        self.sources: list[tuple[Region, Region]] = []
        """Per slot: (held region, source piece, storage dim)."""
        self.outers: list[Region] = []
        self.slot_outer: list[int] = []
        """The distinct held regions of ``sources``, and per slot the index of its own: one store
        lookup per held region, not per piece."""
        self.rounds = 0
        self.geometry: Geometry | None = None
        self.cover_checked = False
        self.layouts: dict[tuple[Region, ...], list[tuple]] = {}
        """The new regions' carving out of the arena (``arena.layout_of``), per tuple of kept
        regions relocated with them (almost always none)."""
        self.joins: dict[tuple[int, int, int], tuple[list, list]] = {}
        """Per exchange's items (keyed by their count and first and last piece's ids): (their
        pieces, to check the key, and the join plan ``_merged`` derived for them)."""


class Geometry:
    """Per slot and per op: the ``as_strided`` (sizes, strides, offset from the tensor's own
    storage offset) of the piece's wire view, or None where it is the whole tensor, with the
    strides of the tensors it was computed for and whether each piece is one dense block."""

    def __init__(self, strides: tuple, src: list, dst: list, dense: list[bool]) -> None:
        self.strides = strides
        self.src = src
        self.dst = dst
        self.dense = dense
        self.cache: dict = {}
        """What else is a function of these views alone: the staged bytes per round per bucket
        size, and the compiled programs (``reshard.program``)."""


def recipe(plan: TransitionPlan, rank: int, major: dict[tuple[str, str], int]) -> Recipe:
    """The cached recipe of (plan, rank), or a new (empty) one."""
    key = (id(plan), rank)
    with _lock:
        r = _cache.get(key)
        if r is not None and r.plan is plan and r.major == major:
            _cache.move_to_end(key)
            return r
        r = _cache[key] = Recipe(plan, rank, major)
        mine = [k for k in _cache if k[1] == rank]  # oldest first
        for k in mine[:max(0, len(mine) - CACHE_SIZE)]:
            del _cache[k]
        return r


def clear() -> None:
    with _lock:
        _cache.clear()


def geometry(t: torch.Tensor, outer: Region, inner: Region, dim: int) -> tuple | None:
    """``as_strided`` parameters of ``inner``'s part of ``t`` (which holds ``outer``), ``dim``
    moved first; None when that view is ``t`` itself."""
    if dim == 0 and outer.offsets == inner.offsets and outer.lengths == inner.lengths:
        return None
    stride = t.stride()
    at = 0
    for k, (o, i) in enumerate(zip(outer.offsets, inner.offsets)):
        if o != i:
            at += (i - o) * stride[k]
    sizes = inner.lengths
    if dim:
        sizes = (sizes[dim], *sizes[:dim], *sizes[dim + 1:])
        stride = (stride[dim], *stride[:dim], *stride[dim + 1:])
    return sizes, stride, at


def dense(sizes: tuple, stride: tuple) -> bool:
    """Whether a view of these sizes and strides is one dense row-major block (``is_contiguous``)."""
    if 0 in sizes:
        return True
    expect = 1
    for n, s in zip(reversed(sizes), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def view(t: torch.Tensor, geo: tuple | None) -> torch.Tensor:
    return t if geo is None else t.as_strided(geo[0], geo[1], t.storage_offset() + geo[2])


def join_key(items: list[tuple]) -> tuple[int, int, int]:
    return (len(items), id(items[0][4]), id(items[-1][4])) if items else (0, 0, 0)


def same_items(pieces: list, items: list[tuple]) -> bool:
    """``items`` are the exchange a join plan was derived for: the same pieces (objects) in the
    same directions and peers."""
    if len(pieces) != len(items):
        return False
    for (piece, what, peer), it in zip(pieces, items):
        if piece is not it[4] or what != it[0] or (what != "copy" and peer != it[1]):
            return False
    return True


def join_record(items: list[tuple]) -> list[tuple]:
    """What ``same_items`` compares: per item, its piece, direction and peer (None for a copy)."""
    return [(it[4], it[0], None if it[0] == "copy" else it[1]) for it in items]
