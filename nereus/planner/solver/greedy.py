"""Greedy baseline (and CP-SAT hint): a few pool templates, each filled by local search.

Per template: start every unit at its most memory-frugal option of the slot's size, then apply the
best single-unit option change that keeps memory feasible and lowers the step time, until none
does. Fast and usually good; it proves nothing (its gap is reported against no bound).
"""
from __future__ import annotations

from nereus.planner.solver.assignment import Assignment, objective
from nereus.planner.solver.candidates import Tables, prune_by_bound
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.solver.structure import Skeleton, greedy_templates


def _fill(t: Tables, sk: Skeleton, max_rounds: int = 50) -> tuple[float, Assignment] | None:
    choices = []
    for u in range(len(t.units)):
        size = sk.slot_size[sk.unit_slot[u]]
        opts = [o for o in t.options[u] if o.size == size]
        if not opts:
            return None
        choices.append(opts)
    cur = [min(opts, key=lambda o: (o.resident_kib + o.transient_kib, sum(o.durations))) for opts in choices]

    def make(options) -> Assignment:
        return Assignment(slot_size=sk.slot_size, slot_parent=sk.slot_parent, unit_slot=sk.unit_slot,
                          unit_option=tuple(options))

    best_obj, ok, _, _ = objective(t, make(cur))
    if not ok:  # frugal start infeasible: try lowering memory of one unit at a time is already minimal
        return None
    for _ in range(max_rounds):
        move = None
        for u, opts in enumerate(choices):
            for o in opts:
                if o is cur[u]:
                    continue
                trial = cur[:u] + [o] + cur[u + 1:]
                obj, ok, _, _ = objective(t, make(trial))
                if ok and obj < best_obj - 1e-12 and (move is None or obj < move[0]):
                    move = (obj, u, o)
        if move is None:
            break
        best_obj, u, o = move
        cur[u] = o
    return best_obj, make(cur)


def greedy(problem: PlanProblem, t: Tables) -> tuple[float, Assignment, Skeleton] | None:
    """Best (objective, assignment, template) over the templates, or None if none fits.

    The first template's answer bounds the step time, so options that cannot beat it are pruned
    (candidates.prune_by_bound) before the remaining templates are searched."""
    best = None
    templates = greedy_templates(problem, t)
    first = _fill(t, templates[0]) if templates else None
    if first is not None:
        best = (first[0], first[1], templates[0])
        t = prune_by_bound(t, first[0])
    for sk in templates[1:]:
        r = _fill(t, sk)
        if r is not None and (best is None or r[0] < best[0]):
            best = (r[0], r[1], sk)
    return best
