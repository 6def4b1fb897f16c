"""Asynchronous schedules solved by rollout size: one small exact model per split instead of one
model that also chooses the split.

An async plan's rollout (generation) pool shares no GPU with any other unit, so a plan is a
rollout size r, a generation option of r GPUs, and a placement of the trainer units on the other
N - r GPUs. Every plan has exactly one r, so the optimum is the least of the sub-problems'
optima, each the same formulation (``formulation.Formulation``) over the option tables filtered to
that r: generation options of size r only, trainer options of at most N - r GPUs. With r fixed
the trainer side gets a GPU-seconds cut over N - r GPUs instead of N, which is where the one big
model's relaxation was weak.

Rollout sizes are first seeded, in the order of a lower bound (``split_bound``), with a plan of
their own (greedy fills, then the thinned warm start) unless the bound already reaches the best
step time found; then solved, best seed first, with the objective cut off at the incumbent, so
proving "no better plan at this size" is usually immediate. The least of the bounds of skipped
sizes and the sub-problems' proven bounds is the bound of the whole.

Worked example (Llama-3.1-70B PPO on 64 H100s, fully_async with a sync every 2 steps; a row of
benchmarks/plan_scaling_async.py). The rollout may take 8, 16, 32, 48 or 56 GPUs. The bounds are
472.6, 450.9 and 677.1 s for 8, 16 and 32 GPUs; on the 16 or 8 GPUs that 48 and 56 leave, some
trainer model-stage has no option that fits and can beat greedy's plan (bound infinite). Seeding
gives 699.3 s at r = 16 and 541.3 s at r = 8, so r = 32 is never solved. r = 8 is solved first
(524.86 s, proven), then r = 16 under the cutoff 524.86 s is infeasible at once: 524.86 s is the
optimum, the same as the one model that also chooses the split.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from nereus.planner.schedules import step_time
from nereus.planner.solver.assignment import Assignment
from nereus.planner.solver.candidates import ACTOR, GEN, TableBuilder, Tables
from nereus.planner.solver.greedy import BOUND_SLACK, tighten
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.solver.structure import Skeleton, placement_skeleton

CUTOFF_SLACK = 1e-7
"""Relative slack of a sub-problem's cutoff: the backends round times to ticks, so a plan equal to
the incumbent must not be cut by rounding (the exact float objective then picks the better)."""


def tables_for(t: Tables, r: int) -> Tables:
    """The option tables of the sub-problem with the rollout on ``r`` GPUs."""
    g, rest = t.unit_index(GEN), t.num_gpus - r
    opts = tuple(tuple(o for o in oo if (o.size == r if u == g else o.size <= rest)) for u, oo in enumerate(t.options))
    return replace(t, options=opts)


def split_bound(t: Tables, r: int) -> float:
    """A lower bound on the step time of any plan with the rollout on ``r`` GPUs (``t`` already
    filtered by ``tables_for``): generation's fastest option of r GPUs against the trainer side,
    whose phases each last at least their slowest unit's fastest option and their least
    GPU-seconds spread over N - r GPUs, plus the cheapest weight sync between the two pools."""
    g, tr, rest = t.unit_index(GEN), t.unit_index(ACTOR), t.num_gpus - r
    if any(not opts for opts in t.options) or rest <= 0:
        return math.inf
    rollout = min(o.durations[0] for o in t.options[g])
    trainer = 0.0
    for ph in range(1, t.n_phases):
        units = [u for u in range(len(t.units)) if u != g and ph in t.units[u].phases]
        if units:
            fastest = max(min(o.durations[ph] for o in t.options[u]) for u in units)
            area = sum(min(o.durations[ph] * o.size for o in t.options[u]) for u in units) / rest
            trainer += max(fastest, area)
    trainer = max([trainer] + [min(sum(o.durations[1:]) for o in t.options[u]) for u in range(len(t.units)) if u != g])
    sizes = {o.size for o in t.options[tr]}
    sync = min(t.sync_s(o, s, False) for o in t.options[g] for s in sizes)
    return step_time(t.schedule, [rollout, trainer] + [0.0] * (t.n_phases - 2), sync)


def floor_bound(b: TableBuilder, r: int, low: dict, upper: float) -> float:
    """``split_bound`` of the rollout on ``r`` GPUs over floors: ``low`` maps each (unit, pool size)
    group that may hold an option of the size's tables to its floor per phase (``greedy.group_floor``:
    at most every option's duration); generation's weight sync counts at 0 until its group is priced.
    Every term is a least value over at most those options, so this is at most ``split_bound`` of the
    size's tightened tables, and a size it puts at or above the incumbent would be skipped."""
    g, tr, rest = b.unit_index(GEN), b.unit_index(ACTOR), b.num_gpus - r
    units = range(len(b.units))
    if rest <= 0 or any(not any(k[0] == u for k in low) for u in units):
        return math.inf
    fast = {u: [min(f[ph] for k, f in low.items() if k[0] == u) for ph in range(b.n_phases)] for u in units}
    area = {u: [min(f[ph] * k[1] for k, f in low.items() if k[0] == u) for ph in range(b.n_phases)] for u in units}
    trainer = 0.0
    for ph in range(1, b.n_phases):
        us = [u for u in units if u != g and ph in b.units[u].phases]
        if us:
            trainer += max(max(fast[u][ph] for u in us), sum(area[u][ph] for u in us) / rest)
    trainer = max([trainer] + [min(sum(f[1:]) for k, f in low.items() if k[0] == u) for u in units if u != g])
    rollout, sync = fast[g][0], 0.0
    if (g, r) in b.priced:  # generation's options that tightening may keep: its own test in
        # greedy._prune_pass against the others' floors (at most their least times), so a superset
        spread = [sum(area[u][ph] for u in units if u != g) for ph in range(b.n_phases)]
        most = [max((fast[u][ph] for u in units if u != g), default=0.0) for ph in range(b.n_phases)]
        keep = [o for o in b.priced[g, r] if step_time(b.schedule, [max(o.durations[0], (o.durations[0] * r + spread[0])
                / b.num_gpus, most[0])] + [max(spread[ph] / rest, most[ph]) for ph in range(1, b.n_phases)],
                min(o.sync)) <= upper * (1 + BOUND_SLACK)]
        if not keep:
            return math.inf
        sizes = {k[1] for k in low if k[0] == tr}
        rollout = min(o.durations[0] for o in keep)
        sync = min((b.sync_s(o, s, False) for o in keep for s in sizes), default=0.0)
    return step_time(b.schedule, [rollout, trainer] + [0.0] * (b.n_phases - 2), sync)


def _templates(t: Tables, r: int) -> list[Skeleton]:
    """Greedy starts for one r: the rollout alone on r GPUs beside the trainers together on the
    largest pool that fits, or each on a pool of its own."""
    g, n, rest = t.unit_index(GEN), len(t.units), t.num_gpus - r
    together = max((s for s in t.sizes if s <= rest), default=None)
    apart = max((s for s in t.sizes if s * (n - 1) <= rest), default=None)
    out = []
    if together is not None:
        out.append(Skeleton(slot_size=(r, together), slot_parent=(-1, -1), unit_slot=tuple(0 if u == g else 1 for u in range(n))))
    if apart is not None:
        others = [u for u in range(n) if u != g]
        out.append(Skeleton(slot_size=(r,) + (apart,) * (n - 1), slot_parent=(-1,) * n,
                            unit_slot=tuple(0 if u == g else 1 + others.index(u) for u in range(n))))
    return out + _nested_templates(t, r, together)


def _nested_templates(t: Tables, r: int, together: int | None) -> list[Skeleton]:
    """The trainable units on the trainer pool, the frozen ones (ref, reward) nested inside it:
    together on one smaller pool, one inside the other, or side by side (what the optimum of PPO
    70B on 64 GPUs looks like: actor + critic on 56, ref on 48 inside, reward on 32 inside that)."""
    g, n = t.unit_index(GEN), len(t.units)
    frozen = [u for u in range(n) if u != g and not t.units[u].name.endswith("/training")]
    if together is None or not frozen or len(frozen) == n - 1:
        return []
    below = sorted((s for s in t.sizes if s < together), reverse=True)
    out = []

    def add(sizes, parents, slot_of):
        out.append(Skeleton(slot_size=(r, together) + tuple(sizes), slot_parent=(-1, -1) + tuple(parents),
                            unit_slot=tuple(0 if u == g else slot_of.get(u, 1) for u in range(n))))

    for c in below[:2]:  # all frozen units on one pool inside the trainers'
        add((c,), (1,), {u: 2 for u in frozen})
    if len(frozen) == 2:
        a, b = frozen
        for c1 in below[:2]:  # one inside the other
            for c2 in [s for s in below if s < c1][:2]:
                add((c1, c2), (1, 2), {a: 2, b: 3})
                add((c1, c2), (1, 2), {b: 2, a: 3})
        pairs = [(x, y) for x in below for y in below if y <= x and x + y <= together][:2]
        for c1, c2 in pairs:  # side by side
            add((c1, c2), (1, 1), {a: 2, b: 3})
            if c1 != c2:
                add((c1, c2), (1, 1), {b: 2, a: 3})
    return out


def solve_split_lazy(problem: PlanProblem, b: TableBuilder, hint, backend: str, time_limit_s: float, workers: int,
                     seed: int, deterministic: bool = False, warm_start=None):
    """``solve_split`` of ``tighten(price_groups(b, hint[0]), hint[0])`` (what ``solve`` gave it before)
    with only what each rollout size needs priced. Every size r gets its own tables at greedy's
    objective h, priced per size (``price_groups(b, h, r)``: generation on r GPUs, trainers on at
    most N - r, the trainer phases spread over N - r; floors rule out a whole size unpriced) and
    tightened with rest = N - r: the same tables ``solve_split``'s seeding tightens a size to (every
    option they keep survives the cluster-wide tightening too, whose bound is weaker), and a bound
    at least the size's bound there. A size whose bound reaches h is skipped by ``solve_split``
    wherever it comes in the order (its incumbent is at most h, its bound only rises). The sizes left
    are solved from these tables: each is the table ``solve_split`` would cut from the cluster-wide
    ones (``test_each_rollout_size_priced_alone_gets_the_tables_of_the_full_ones``), so its bound,
    the order of the sizes, the seeding, the cutoffs and the plan are the same, with one size left or
    several (``test_solving_each_rollout_size_lazily_returns_the_plan_of_the_cluster_wide_tables``:
    70B on 64 GPUs and 8B one_step_off on 1,024 leave two or more). Until 2026-12-02 two or more sizes
    left priced every group instead: 8B one_step_off on 1,024 GPUs took 0.51 s once the cross-pool
    weight sync, the same for every size, left two sizes within greedy's 0.3%."""
    from nereus.planner.solver.greedy import group_floor, price_groups

    g, N, h = b.unit_index(GEN), b.num_gpus, hint[0]
    subs = []
    for r in b.sizes:
        alone = step_time(b.schedule, [group_floor(b, g, r)[0]] + [0.0] * (b.n_phases - 1), 0.0)
        if alone >= h:  # generation's floor on r GPUs alone (at most split_bound's rollout term)
            subs.append((alone, r, None))
            continue
        low = {}

        def give_up(floors, r=r, low=low):
            low[0] = floor_bound(b, r, floors, h)
            return low[0] >= h

        if price_groups(b, h, rollout=r, give_up=give_up) is None:  # ruled out on floors: skipped, as
            subs.append((low[0], r, None))  # split_bound of its tables (at least low[0]) would have it
            continue
        tr = tighten(tables_for(b.tables(), r), h, rest=N - r)
        subs.append((split_bound(tr, r), r, tr))
    return solve_split(problem, b.tables(), hint, backend, time_limit_s, workers, seed, deterministic, warm_start,
                       subs=[x for x in subs if x[1] < N])


def solve_split(problem: PlanProblem, t: Tables, hint, backend: str, time_limit_s: float, workers: int, seed: int,
                deterministic: bool = False, warm_start=None, subs=None):
    """(status, assignment or None, bound seconds) of an async problem, like ``solve._run_backend``.
    ``warm_start(problem, tables, hint, time_limit_s, workers, seed, deterministic)``, when given,
    improves each sub-problem's hint before it is solved (``solve._warm_start``). ``subs``: the
    (bound, rollout size, tables) of each size, when the caller has them (``solve_split_lazy``)."""
    from nereus.planner.solver.assignment import objective

    t0 = time.perf_counter()
    g, N = t.unit_index(GEN), t.num_gpus
    best: tuple[float, Assignment] | None = (hint[0], hint[1]) if hint is not None else None
    if subs is None:
        subs = []
        for r in sorted({o.size for o in t.options[g] if o.size < N}):
            tr = tables_for(t, r)
            subs.append((split_bound(tr, r), r, tr))
    subs.sort(key=lambda x: (x[0], x[1]))
    bound, proven = math.inf, True
    # first a good plan for each rollout size that may still win (its greedy fill, then the warm
    # start), so that the sizes solved next are cut off at the best step time any of them reached
    hints = {}
    # the templates place pools freely: with a placement constraint only the caller's greedy plan
    # (from its pinned templates) and the warm start (the formulation's own rules) may seed a size
    free = problem.constraints.placement == "any" and placement_skeleton(problem, t) is None
    for i, (lb, r, tr) in enumerate(subs):
        if best is not None and lb >= best[0]:
            continue
        if best is not None:  # the incumbent prunes this size's tables, and its bound rises with them
            tr = tighten(tr, best[0], rest=N - r)
            lb = max(lb, split_bound(tr, r))
            subs[i] = (lb, r, tr)  # a plan at r dropped here is slower than the incumbent: still a bound
            if lb >= best[0]:
                continue
        h = _greedy_fill(tr, r) if free else None
        if best is not None and best[1].unit_option[g].size == r and (h is None or best[0] < h[0]):
            h = best
        if warm_start is not None:
            left = time_limit_s if deterministic else time_limit_s - (time.perf_counter() - t0)
            h = warm_start(problem, tr, h, max(left, 0.0), workers, seed, deterministic)
        hints[r] = h
        if h is not None and (best is None or h[0] < best[0]):
            best = (h[0], h[1])
    # then each rollout size that may still win, the most promising first, cut off at the incumbent
    order = sorted(subs, key=lambda x: (hints[x[1]][0] if hints.get(x[1]) else math.inf, x[0], x[1]))
    for i, (lb, r, tr) in enumerate(order):
        upper = best[0] if best is not None else math.inf
        if lb >= upper:
            bound = min(bound, lb)
            continue
        left = time_limit_s if deterministic else time_limit_s - (time.perf_counter() - t0)
        if left <= 0:  # out of time: the bounds of the sizes not yet solved still bound the optimum
            proven = False
            bound = min([bound] + [x[0] for x in order[i:]])
            break
        tr = tighten(tr, upper, rest=N - r)
        if any(not opts for opts in tr.options):
            bound = min(bound, upper)  # nothing at this size can beat the incumbent
            continue
        status, a, sub_bound = _solve_one(problem, tr, hints.get(r), upper, backend, left, workers, seed, deterministic)
        if a is not None:
            obj, ok, _, _ = objective(t, a)
            if ok and (best is None or obj < best[0]):
                best = (obj, a)
        if status == "INFEASIBLE":  # no plan at this size beats the cutoff (or none fits at all)
            sub_bound = upper
        elif status != "OPTIMAL":
            proven = False
        bound = min(bound, sub_bound if math.isfinite(sub_bound) else lb)
    if best is None:
        return ("INFEASIBLE", None, math.inf) if proven else ("UNKNOWN", None, math.nan)
    return ("OPTIMAL" if proven else "FEASIBLE"), best[1], min(bound, best[0])


def _greedy_fill(t: Tables, r: int):
    """The best greedy fill of ``_templates`` (objective, assignment), or None."""
    from nereus.planner.solver.greedy import _fill

    best = None
    for sk in _templates(t, r):
        got = _fill(t, sk)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    return best


def _solve_one(problem: PlanProblem, t: Tables, hint, upper: float, backend: str, time_limit_s: float, workers: int,
               seed: int, deterministic: bool):
    """One sub-problem with the cutoff: (status, assignment or None, bound seconds)."""
    from nereus.planner.solver.formulation import Formulation

    form = Formulation(problem, t)
    if math.isfinite(upper):
        form.add_cutoff(upper * (1 + CUTOFF_SLACK))
    if hint is not None:
        form.set_hint(hint[1])
    from nereus.planner.solver.backends import solve_formulation

    status, value, bound = solve_formulation(form, backend, time_limit_s, workers, seed, deterministic)
    if value is None:
        return status, None, math.nan
    return status, form.assignment(value), bound
