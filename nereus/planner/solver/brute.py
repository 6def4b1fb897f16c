"""Exhaustive oracle over the same option tables, but over concrete aligned GPU blocks instead of
the slot forest: every unit gets a (block, option) pair, memory and makespans are summed GPU
segment by GPU segment. Exact depth-first search with two safe cuts (memory only grows as units
are added; the partial objective only grows). Refuses instances above ``limit`` combinations.
"""
from __future__ import annotations

import math

from nereus.errors import SpecError
from nereus.planner.schedules import step_time
from nereus.planner.solver.assignment import Assignment
from nereus.planner.solver.candidates import ACTOR, GEN, Tables
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.solver.structure import placement_skeleton

DEFAULT_LIMIT = 2_000_000_000


def blocks(cluster, sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Every aligned (first_gpu, size) block: the positions the brute-force oracle enumerates."""
    n = cluster.num_gpus
    return tuple((start, s) for s in sizes for start in range(0, n - s + 1, s) if s != n or start == 0)


def _unit_blocks(problem: PlanProblem, t: Tables) -> list[list[tuple[int, int]]]:
    all_blocks = blocks(problem.cluster, t.sizes)
    sk = placement_skeleton(problem, t)
    out = []
    for u in range(len(t.units)):
        if sk is not None:
            k = sk.unit_slot[u]
            first = sk.slot_first[k] if sk.slot_first else 0
            out.append([(first, sk.slot_size[k])])
        else:
            out.append(list(all_blocks))
    return out


def count(problem: PlanProblem, t: Tables) -> int:
    ub = _unit_blocks(problem, t)
    total = 1
    for u, bl in enumerate(ub):
        total *= sum(sum(1 for o in t.options[u] if o.size == s) for _, s in bl)
    return total


def brute(problem: PlanProblem, t: Tables, limit: int = DEFAULT_LIMIT) -> tuple[float, Assignment] | None:
    """(optimal objective, assignment), or None when nothing fits. SpecError above ``limit``."""
    n_comb = count(problem, t)
    if n_comb > limit:
        raise SpecError(f"brute force: {n_comb:,} (block, option) combinations > limit {limit:,}; "
                        f"use --backend cpsat or a smaller instance")
    disagg = problem.constraints.placement == "disaggregated" and problem.constraints.fixed_placement is None
    search = _Search(t, _unit_blocks(problem, t), disagg)
    search.rec(0)
    if search.best is None:
        return None
    return search.best_obj, _to_assignment(t, search.best)


class _Search:
    """Depth-first search over units (generation and actor training first, so the weight sync
    enters the bound early), with per-segment resident / transient / phase-load arrays."""

    def __init__(self, t: Tables, unit_blocks, disaggregated: bool) -> None:
        self.t, self.unit_blocks, self.disagg = t, unit_blocks, disaggregated
        self.seg = min(t.sizes)
        nseg = t.num_gpus // self.seg
        self.g, self.tr = t.unit_index(GEN), t.unit_index(ACTOR)
        self.order = sorted(range(len(t.units)), key=lambda u: (u not in (self.g, self.tr), u))
        self.res, self.tra, self.owner = [0] * nseg, [0] * nseg, [0] * nseg
        self.load = [[0.0] * nseg for _ in range(t.n_phases)]
        self.chosen: dict[int, tuple] = {}
        self.best_obj, self.best = math.inf, None

    def partial_obj(self) -> float:
        """The objective of the units chosen so far (step_time only grows with more units)."""
        sync = 0.0
        if self.g in self.chosen and self.tr in self.chosen:
            (bg, og), (bt, ot) = self.chosen[self.g], self.chosen[self.tr]
            col = bg[0] < bt[0] + bt[1] and bt[0] < bg[0] + bg[1]
            sync = self.t.sync_s(og, ot.size, col)
        return step_time(self.t.schedule, [max(row) for row in self.load], sync)

    def rec(self, i: int) -> None:
        if i == len(self.order):
            obj = self.partial_obj()
            if obj < self.best_obj - 1e-12:
                self.best_obj, self.best = obj, dict(self.chosen)
            return
        u = self.order[i]
        for blk in self.unit_blocks[u]:
            segs = range(blk[0] // self.seg, (blk[0] + blk[1]) // self.seg)
            if self.disagg and any(self.owner[s] for s in segs):
                continue
            if self.t.schedule.is_async and u != self.g and self.g in self.chosen:
                bg = self.chosen[self.g][0]  # an async plan's rollout pool is its own
                if bg[0] < blk[0] + blk[1] and blk[0] < bg[0] + bg[1]:
                    continue
            for o in self.t.options[u]:
                if o.size == blk[1]:
                    self.try_option(i, u, blk, segs, o)

    def try_option(self, i: int, u: int, blk, segs, o) -> None:
        t, saved, ok = self.t, [], True
        for s in segs:
            saved.append((s, self.res[s], self.tra[s], [row[s] for row in self.load]))
            self.res[s] += o.resident_kib
            self.tra[s] = max(self.tra[s], o.transient_kib)
            ok &= self.res[s] + self.tra[s] <= t.capacity_kib  # memory only grows with more units
            self.owner[s] += 1
            for ph in range(t.n_phases):
                self.load[ph][s] += o.durations[ph]
        self.chosen[u] = (blk, o)
        if ok and self.partial_obj() < self.best_obj - 1e-12:  # the objective only grows too
            self.rec(i + 1)
        del self.chosen[u]
        for s, r0, t0, l0 in saved:
            self.res[s], self.tra[s] = r0, t0
            self.owner[s] -= 1
            for ph in range(t.n_phases):
                self.load[ph][s] = l0[ph]


def _to_assignment(t: Tables, chosen: dict) -> Assignment:
    """Blocks -> slot forest (distinct blocks, parent = smallest strictly containing block)."""
    bl = sorted({chosen[u][0] for u in chosen}, key=lambda b: (-b[1], b[0]))
    parent = []
    for i, (f, s) in enumerate(bl):
        par = -1
        for j in range(i):
            pf, ps = bl[j]
            if pf <= f and f + s <= pf + ps and s < ps:
                par = j
        parent.append(par)
    return Assignment(slot_size=tuple(s for _, s in bl), slot_parent=tuple(parent),
                      unit_slot=tuple(bl.index(chosen[u][0]) for u in range(len(t.units))),
                      unit_option=tuple(chosen[u][1] for u in range(len(t.units))))
