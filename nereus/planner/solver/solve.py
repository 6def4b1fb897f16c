"""``solve(problem, backend=...)``: option tables -> greedy -> chosen backend -> Plan.

All backends optimise the same option tables; the reported objective is always recomputed in
floating point from the chosen assignment (assignment.objective), so backends are comparable.
"""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import replace

from nereus.errors import SpecError
from nereus.planner.plan import Plan
from nereus.planner.solver.assignment import check_structure, objective, to_plan
from nereus.planner.solver.candidates import TableBuilder, Tables, build_tables, table_builder
from nereus.planner.solver.check import evaluate_plan
from nereus.planner.solver.greedy import greedy, price_groups, tighten
from nereus.planner.solver.infeasible import explain_infeasible
from nereus.planner.solver.problem import PlanProblem, PlanSolution, default_transition_cost
from nereus.planner.solver.structure import placement_skeleton

BACKENDS = ("cpsat", "pulp", "greedy", "brute")


def _infeasible(problem: PlanProblem, backend: str, t0: float, why: str = "") -> PlanSolution:
    return PlanSolution(status="INFEASIBLE", objective=math.inf, bound=math.inf, gap=math.nan, plan=None,
                        wall_s=time.perf_counter() - t0, backend=backend, message=why or explain_infeasible(problem))


def _tables_and_greedy(problem: PlanProblem, backend: str) -> tuple[Tables, tuple | None]:
    """The option tables and greedy's answer. Every backend but brute (which needs every option)
    prices only what it needs: greedy prices the groups it fills (``TableBuilder``), ``price_groups``
    the others greedy's plan cannot rule out; tightened by that plan they are the full tables
    tightened (without a greedy plan, every group is priced; the greedy backend needs no more)."""
    if backend == "brute":
        t = build_tables(problem)
        return t, greedy(problem, t)
    b = table_builder(problem)
    hint = greedy(problem, b)
    if hint is None:
        return b.full(), hint
    if backend != "greedy" and problem.job.schedule.is_async:  # priced per rollout size (split.solve_split_lazy)
        return b, hint
    return (b.tables() if backend == "greedy" else price_groups(b, hint[0])), hint


def _run_backend(problem: PlanProblem, t: Tables, hint, backend: str, time_limit_s: float, workers: int, seed: int,
                 deterministic: bool = False):
    """(status, assignment or None, bound seconds), from greedy's answer ``hint``."""
    if backend == "greedy":
        return ("FEASIBLE", hint[1], math.nan) if hint else ("INFEASIBLE", None, math.nan)
    if backend == "brute":
        from nereus.planner.solver.brute import brute

        r = brute(problem, t)
        return ("OPTIMAL", r[1], r[0]) if r else ("INFEASIBLE", None, math.inf)
    from nereus.planner.solver.formulation import Formulation

    if isinstance(t, TableBuilder):  # an async problem with greedy's plan: each rollout size priced on its own
        from nereus.planner.solver.split import solve_split_lazy

        warm = _warm_start_if_large if backend == "cpsat" else None
        return solve_split_lazy(problem, t, hint, backend, time_limit_s, workers, seed, deterministic, warm)
    if hint is not None:
        t = tighten(t, hint[0])
    if t.schedule.is_async:  # one small exact model per rollout size (split.py)
        from nereus.planner.solver.split import solve_split

        warm = _warm_start_if_large if backend == "cpsat" else None
        return solve_split(problem, t, hint, backend, time_limit_s, workers, seed, deterministic, warm)
    if backend == "cpsat" and sum(len(o) for o in t.options) > WARM_START_MIN_OPTIONS:
        hint = _warm_start(problem, t, hint, time_limit_s, workers, seed, deterministic)
        if hint is not None:  # re-prune with the (usually better) objective of the warm start
            t = tighten(t, hint[0])
    form = Formulation(problem, t)
    if hint is not None:
        form.set_hint(hint[1])
    from nereus.planner.solver.backends import solve_formulation

    status, value, bound = solve_formulation(form, backend, time_limit_s, workers, seed, deterministic)
    if value is None:
        if status == "INFEASIBLE":
            return "INFEASIBLE", None, math.inf
        # time limit without a solution: fall back to the greedy answer, bound unknown
        return ("FEASIBLE", hint[1], math.nan) if hint else ("UNKNOWN", None, math.nan)
    return status, form.assignment(value), bound


WARM_START_MIN_OPTIONS = 300
"""Above this many options CP-SAT first solves a thinned model (``thin_options``) for its hint."""
WARM_START_PER_SIZE = 8


def thin_options(t: Tables, k: int = WARM_START_PER_SIZE) -> Tables:
    """Per unit and pool size, ``k`` options spread evenly along the (already Pareto-pruned) front
    from the fastest to the slowest, plus the most memory-frugal: a model small enough to solve at
    once whose every plan is a plan of the full one."""
    keep_all = []
    for opts in t.options:
        keep: list = []
        for size in sorted({o.size for o in opts}):
            group = sorted((o for o in opts if o.size == size), key=lambda o: (sum(o.durations), o.resident_kib))
            if len(group) > k:
                picks = [group[round(i * (len(group) - 1) / (k - 1))] for i in range(k)]
                frugal = min(group, key=lambda o: (o.resident_kib + o.transient_kib, sum(o.durations)))
                group = list(dict.fromkeys(picks + [frugal]))
            keep += group
        keep_all.append(tuple(keep))
    return replace(t, options=tuple(keep_all))


def _warm_start(problem: PlanProblem, t: Tables, hint, time_limit_s: float, workers: int, seed: int,
                deterministic: bool):
    """A better CP-SAT hint than greedy's: the optimum of the thinned model (``thin_options``). CP-SAT
    spends most of a large instance's time finding the optimum, and proves it at once when hinted
    with it; the thinned optimum is usually the full one or close. Returns ``hint`` unchanged when
    the thinned model does no better (or finds nothing within a tenth of the time limit, which the
    whole solve may then exceed by that tenth)."""
    from nereus.planner.solver.backends import solve_cpsat
    from nereus.planner.solver.formulation import Formulation

    small = thin_options(t)  # every unit keeps an option per pool size it had
    form = Formulation(problem, small)
    if hint is not None and all(hint[1].unit_option[u] in small.options[u] for u in range(len(small.units))):
        form.set_hint(hint[1])
    _, value, _, _ = solve_cpsat(form.m, form.t_hi, time_limit_s / 10, workers, seed, deterministic)
    if value is None:
        return hint
    a = form.assignment(value)
    obj, ok, _, _ = objective(t, a)
    if ok and (hint is None or obj < hint[0]):
        return obj, a, None
    return hint


def _warm_start_if_large(problem: PlanProblem, t: Tables, hint, time_limit_s: float, workers: int, seed: int,
                         deterministic: bool):
    """``_warm_start`` when ``t`` (a rollout size's tables, already tightened) has more than
    ``WARM_START_MIN_OPTIONS`` options; below that the model is solved at once without it."""
    if sum(len(o) for o in t.options) <= WARM_START_MIN_OPTIONS:
        return hint
    return _warm_start(problem, t, hint, time_limit_s, workers, seed, deterministic)


@contextmanager
def _no_gc():
    """The cyclic garbage collector off while the search runs: it allocates many small acyclic objects
    (constraints, terms), which set off full collections over everything the process holds (the
    option tables and the cost model's estimates): half the CPU of the first search in a process
    (ppo-8b on 1,024 GPUs: 0.157 s with it, 0.073 s without). Refcounting still frees them; cycles
    wait for the next collection after the search."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _solve_step_time(problem: PlanProblem, backend: str, time_limit_s: float, workers: int, seed: int,
                     t0: float, deterministic: bool = False) -> PlanSolution:
    with _no_gc():
        t, hint = _tables_and_greedy(problem, backend)
    if hint is None and any(not opts for opts in t.options):  # (then greedy found nothing either)
        return _infeasible(problem, backend, t0)
    with _no_gc():
        status, a, bound = _run_backend(problem, t, hint, backend, time_limit_s, workers, seed, deterministic)
    if isinstance(t, TableBuilder):  # (what it priced: the plan reads only the tables' frame)
        t = t.tables()
    if a is None and backend == "greedy":  # a heuristic miss proves nothing
        return PlanSolution(status="INFEASIBLE", objective=math.inf, bound=math.nan, gap=math.nan, plan=None,
                            wall_s=time.perf_counter() - t0, backend=backend,
                            message="greedy found no memory-feasible plan among its pool templates "
                                    "(not a proof; try --backend cpsat)")
    if a is None:
        why = "" if status == "INFEASIBLE" else f"{backend} found no plan within {time_limit_s:g} s"
        return _infeasible(problem, backend, t0, why) if status == "INFEASIBLE" else PlanSolution(
            status="INFEASIBLE", objective=math.inf, bound=math.nan, gap=math.nan, plan=None,
            wall_s=time.perf_counter() - t0, backend=backend, message=why)
    check_structure(a, problem.cluster.num_gpus)  # a backend bug must not become a plan
    obj = objective(t, a)[0]
    if status == "OPTIMAL":  # proven within the backend's tolerance: the gap is what its bound says
        bound = min(bound, obj) if math.isfinite(bound) else obj
    gap = max(0.0, (obj - bound) / obj) if math.isfinite(bound) and obj > 0 else math.nan
    firsts = _pinned_firsts(placement_skeleton(problem, t), a)
    wall = time.perf_counter() - t0
    plan = to_plan(t, a, problem.cluster, status=status, solve_s=wall, gap=gap, backend=backend, firsts=firsts)
    return PlanSolution(status=status, objective=obj, bound=bound, gap=gap, plan=plan, wall_s=wall, backend=backend)


def _pinned_firsts(sk, a) -> tuple[int, ...] | None:
    """First GPU of each of ``a``'s slots where a fixed placement pins them. The MILP numbers its
    slots canonically (by lowest unit), the skeleton by pool size, so each slot is matched through
    one of its units: e.g. pools [0, +8), [0, +4) (critic), [4, +4) (actor) are slots 0, 1, 2 of
    the skeleton but 0, 2, 1 of the MILP when the actor is the lower unit."""
    if sk is None or sk.slot_first is None:
        return None
    unit_first = [sk.slot_first[k] for k in sk.unit_slot]
    return tuple(next(unit_first[u] for u, k in enumerate(a.unit_slot) if k == slot) for slot in range(len(a.slot_size)))


def solve(problem: PlanProblem, backend: str = "cpsat", time_limit_s: float = 10.0, workers: int = 1,
          seed: int = 0, deterministic: bool = False) -> PlanSolution:
    """Best memory-feasible plan for ``problem`` (see README.md for the formulation).
    ``deterministic`` (CP-SAT): the time limit counts the solver's work, not seconds, so the same
    inputs give the same plan however loaded the machine is (``solve_cpsat``)."""
    if backend not in BACKENDS:
        raise SpecError(f"unknown solver backend {backend!r}; choose one of {BACKENDS}")
    if problem.job.schedule.kind == "auto":
        return _solve_schedules(problem, backend, time_limit_s, workers, seed, deterministic)
    t0 = time.perf_counter()
    sol = _solve_step_time(problem, backend, time_limit_s, workers, seed, t0, deterministic)
    if problem.current_plan is None or problem.amortize_steps <= 0:
        return sol
    return _transition_aware(problem, sol, backend, time_limit_s, workers, seed, t0, deterministic)


def _transition_aware(problem: PlanProblem, best: PlanSolution, backend: str, time_limit_s: float, workers: int,
                      seed: int, t0: float, deterministic: bool = False) -> PlanSolution:
    """Objective += transition_cost(current, new) / amortize_steps, over the candidate plans: the
    step-time optimum, the current pools with re-chosen configs, and the current plan itself.
    The step-time bound stays a valid lower bound (transition costs are >= 0)."""
    cur = problem.current_plan
    cost = problem.transition_cost or default_transition_cost(problem)
    cands: list[Plan] = [best.plan] if best.plan is not None else []
    try:
        fixed = replace(problem, current_plan=None, amortize_steps=0.0,
                        constraints=replace(problem.constraints, fixed_placement=cur))
        s2 = _solve_step_time(fixed, backend, time_limit_s, workers, seed, t0, deterministic)
        if s2.plan is not None:
            cands.append(s2.plan)
    except SpecError:
        pass  # the current pools are not a laminar buddy family: skip that candidate
    try:
        ev = evaluate_plan(problem, cur)
    except SpecError:  # the current plan lacks a model-stage of this job
        ev = None
    if ev is not None and ev.feasible:
        cands.append(replace(cur, step_time_s=ev.step_time_s))
    if not cands:
        return best
    scored = [(p.step_time_s + cost(cur, p) / problem.amortize_steps, i, p) for i, p in enumerate(cands)]
    obj, _, plan = min(scored, key=lambda x: (x[0], x[1]))
    bound = best.bound if math.isfinite(best.bound) else math.nan
    proven = best.status == "OPTIMAL" and math.isfinite(bound) and obj <= bound * (1 + 1e-9)
    status = "OPTIMAL" if proven else "FEASIBLE"
    if proven:  # the objective meets the bound within the backend's tolerance: report it met
        bound = obj
    gap = 0.0 if proven else (max(0.0, (obj - bound) / obj) if math.isfinite(bound) else math.nan)
    wall = time.perf_counter() - t0
    plan = replace(plan, status=status, gap=gap, solve_s=wall, backend=backend,
                   extras=(*plan.extras, ("transition_s", cost(cur, plan))))
    return PlanSolution(status=status, objective=obj, bound=bound, gap=gap, plan=plan, wall_s=wall, backend=backend)


def _solve_schedules(problem: PlanProblem, backend: str, time_limit_s: float, workers: int, seed: int,
                     deterministic: bool) -> PlanSolution:
    """``schedule: auto``: the best plan of each schedule the staleness bound admits, each solved
    exactly, and the fastest of them. The minimum of proven optima is proven optimal (its bound is
    the least of the bounds); the plan records every schedule's step time (``schedule_step_s``)."""
    t0 = time.perf_counter()
    sols = {k: solve(replace(problem, job=problem.job.with_schedule(k)), backend, time_limit_s, workers, seed,
                     deterministic) for k in problem.job.schedule.candidates()}
    feasible = {k: s for k, s in sols.items() if s.plan is not None}
    wall = time.perf_counter() - t0
    if not feasible:
        first = next(iter(sols.values()))
        return replace(first, wall_s=wall, message="; ".join(f"{k}: {s.message}" for k, s in sols.items()))
    kind, best = min(feasible.items(), key=lambda kv: (kv[1].objective, list(sols).index(kv[0])))
    proven = all(s.status in ("OPTIMAL", "INFEASIBLE") and s.backend != "greedy" for s in sols.values())
    bounds = [s.bound for s in feasible.values()]
    bound = min(bounds) if all(math.isfinite(b) for b in bounds) else math.nan
    status = "OPTIMAL" if proven else "FEASIBLE"
    gap = 0.0 if proven else (max(0.0, (best.objective - bound) / best.objective) if math.isfinite(bound) else math.nan)
    steps = {k: (s.objective if s.plan is not None else None) for k, s in sols.items()}
    extras = tuple((k, v) for k, v in best.plan.extras if k != "schedule") + (
        ("schedule", problem.job.schedule.fixed(kind).to_dict()), ("schedule_step_s", steps))
    plan = replace(best.plan, status=status, gap=gap, solve_s=wall, extras=extras)
    return replace(best, status=status, bound=bound, gap=gap, plan=plan, wall_s=wall)
