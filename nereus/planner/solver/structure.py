"""Pool skeletons: the slot forest and unit -> slot map, without options.

Used for placement constraints (colocated, fixed pools of a given plan) and as the starting
templates of the greedy heuristic.
"""
from __future__ import annotations

from dataclasses import dataclass

from nereus.errors import SpecError
from nereus.planner.solver.candidates import GEN, Tables
from nereus.planner.solver.problem import PlanProblem


@dataclass(frozen=True, slots=True, kw_only=True)
class Skeleton:
    slot_size: tuple[int, ...]
    slot_parent: tuple[int, ...]
    unit_slot: tuple[int, ...]
    slot_first: tuple[int, ...] | None = None
    """GPU ranges to keep (fixed placement); None lets assignment.place choose."""


def skeleton_from_plan(problem: PlanProblem, t: Tables) -> Skeleton:
    """The pools of ``constraints.fixed_placement`` as a slot forest (they must be nested or disjoint)."""
    plan = problem.constraints.fixed_placement
    homes = [plan.stage(u.name) for u in t.units]
    for s in homes:
        if s.first_gpu + s.gpus > t.num_gpus:
            raise SpecError(f"fixed placement: {s.name} uses GPUs [{s.first_gpu}, {s.first_gpu + s.gpus}) "
                            f"beyond the cluster's {t.num_gpus}")
    pools = sorted({(s.first_gpu, s.gpus) for s in homes}, key=lambda p: (-p[1], p[0]))
    parent = []
    for i, (f, g) in enumerate(pools):
        par = -1
        for j in range(i):
            pf, pg = pools[j]
            inside = pf <= f and f + g <= pf + pg
            apart = f + g <= pf or pf + pg <= f
            if not inside and not apart:
                raise SpecError(f"fixed placement: pools [{f}, +{g}) and [{pf}, +{pg}) overlap without nesting")
            if inside and (g < pg):
                par = j  # the last (smallest) container wins: pools are sorted by size descending
            elif inside:
                raise SpecError(f"fixed placement: pool [{f}, +{g}) listed twice")
        parent.append(par)
    unit_slot = tuple(pools.index((s.first_gpu, s.gpus)) for s in homes)
    return Skeleton(slot_size=tuple(g for _, g in pools), slot_parent=tuple(parent), unit_slot=unit_slot,
                    slot_first=tuple(f for f, _ in pools))


def placement_skeleton(problem: PlanProblem, t: Tables) -> Skeleton | None:
    """The skeleton a placement constraint pins, or None when the solver chooses pools."""
    c = problem.constraints
    if c.fixed_placement is not None:
        return skeleton_from_plan(problem, t)
    if c.placement == "colocated":
        return Skeleton(slot_size=(t.num_gpus,), slot_parent=(-1,), unit_slot=(0,) * len(t.units))
    return None


def greedy_templates(problem: PlanProblem, t: Tables) -> list[Skeleton]:
    """Colocated, generation apart, and every unit apart, at buddy sizes that fit."""
    pinned = placement_skeleton(problem, t)
    if pinned is not None:
        return [pinned]
    n, N, g = len(t.units), t.num_gpus, t.unit_index(GEN)
    halves = [s for s in t.sizes if 2 * s <= N]
    apart = []
    if problem.constraints.placement == "disaggregated" or halves:
        each = max((s for s in t.sizes if n * s <= N), default=None)
        if each is not None:
            apart.append(Skeleton(slot_size=(each,) * n, slot_parent=(-1,) * n, unit_slot=tuple(range(n))))
    if problem.constraints.placement == "disaggregated":
        return apart
    if t.schedule.is_async:  # the rollout pool on its own, the trainers together: both ways round
        out = []
        for s in sorted(halves, reverse=True)[:3]:
            rest = max(x for x in t.sizes if x + s <= N)
            for gen_size, train_size in {(s, rest): None, (rest, s): None}:  # (one split when s is half)
                out.append(Skeleton(slot_size=(train_size, gen_size), slot_parent=(-1, -1),
                                    unit_slot=tuple(1 if u == g else 0 for u in range(n))))
        return out + apart
    out = [Skeleton(slot_size=(N,), slot_parent=(-1,), unit_slot=(0,) * n)]
    for s in sorted(halves, reverse=True)[:3]:
        rest = max(x for x in t.sizes if x + s <= N)
        # generation alone; everything else together
        out.append(Skeleton(slot_size=(rest, s), slot_parent=(-1, -1),
                            unit_slot=tuple(1 if u == g else 0 for u in range(n))))
        # generation inside the whole cluster's pool but on its own part: nested hybrid
        out.append(Skeleton(slot_size=(N, s), slot_parent=(-1, 0),
                            unit_slot=tuple(1 if u == g else 0 for u in range(n))))
    return out + apart
