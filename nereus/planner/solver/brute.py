"""Exhaustive oracle over the same option tables, but over concrete aligned GPU blocks instead of
the slot forest: every unit gets a (block, option) pair, memory and makespans are summed GPU
segment by GPU segment. Exact depth-first search with two safe cuts (memory only grows as units
are added; the partial objective only grows). Refuses instances above ``limit`` combinations.
"""
from __future__ import annotations

import math

from nereus.errors import SpecError
from nereus.planner.solver.assignment import Assignment
from nereus.planner.solver.candidates import ACTOR, GEN, Tables, blocks
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.solver.structure import placement_skeleton

DEFAULT_LIMIT = 2_000_000_000


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
    n_comb = count(problem, t)
    if n_comb > limit:
        raise SpecError(f"brute force: {n_comb:,} (block, option) combinations > limit {limit:,}; "
                        f"use --backend cpsat or a smaller instance")
    seg = min(t.sizes)
    nseg = t.num_gpus // seg
    ub = _unit_blocks(problem, t)
    disagg = problem.constraints.placement == "disaggregated" and problem.constraints.fixed_placement is None
    g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
    order = sorted(range(len(t.units)), key=lambda u: (u not in (g, tr), u))
    n = len(order)
    res = [0] * nseg
    tra = [0] * nseg
    load = [[0.0] * nseg for _ in range(t.n_phases)]
    owner = [0] * nseg  # disaggregated: how many units sit on each segment
    chosen: dict[int, tuple] = {}
    best = [math.inf, None]

    def partial_obj() -> float:
        obj = sum(max(row) for row in load)
        if g in chosen and tr in chosen:
            (bg, og), (bt, ot) = chosen[g], chosen[tr]
            col = bg[0] < bt[0] + bt[1] and bt[0] < bg[0] + bg[1]
            obj += t.sync_s(og, ot.size, col)
        return obj

    def rec(i: int) -> None:
        if i == n:
            obj = partial_obj()
            if obj < best[0] - 1e-12:
                best[0], best[1] = obj, dict(chosen)
            return
        u = order[i]
        for blk in ub[u]:
            first, size = blk
            segs = range(first // seg, (first + size) // seg)
            if disagg and any(owner[s] for s in segs):
                continue
            for o in t.options[u]:
                if o.size != size:
                    continue
                saved = [(s, res[s], tra[s], [load[ph][s] for ph in range(t.n_phases)]) for s in segs]
                ok = True
                for s in segs:
                    res[s] += o.resident_kib
                    tra[s] = max(tra[s], o.transient_kib)
                    ok &= res[s] + tra[s] <= t.capacity_kib
                    owner[s] += 1
                    for ph in range(t.n_phases):
                        load[ph][s] += o.durations[ph]
                chosen[u] = (blk, o)
                if ok and partial_obj() < best[0] - 1e-12:
                    rec(i + 1)
                del chosen[u]
                for s, r0, t0, l0 in saved:
                    res[s], tra[s] = r0, t0
                    owner[s] -= 1
                    for ph in range(t.n_phases):
                        load[ph][s] = l0[ph]

    rec(0)
    if best[1] is None:
        return None
    return best[0], _to_assignment(t, best[1])


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
