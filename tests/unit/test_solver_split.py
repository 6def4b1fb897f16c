"""Async schedules solved one rollout size at a time (solver/split.py): the same optimum as the one
model that also chooses the split, a lower bound per rollout size that never exceeds that size's
own optimum, and sub-problems that really are the plans of one rollout size."""
import math
from dataclasses import replace

import pytest

from nereus.planner.schedules import ScheduleSpec
from nereus.planner.solver import solve
from nereus.planner.solver.assignment import objective
from nereus.planner.solver.backends import solve_cpsat
from nereus.planner.solver.candidates import GEN, build_tables
from nereus.planner.solver.formulation import Formulation
from nereus.planner.solver.split import split_bound, tables_for

from test_solver import random_instance

ONE_STEP = ScheduleSpec(kind="one_step_off")
FULLY2 = ScheduleSpec(kind="fully_async", staleness=2, sync_every=2)


def _async(seed: int, schedule: ScheduleSpec, epochs: int = 1):
    p = random_instance(seed)
    job = replace(p.job, schedule=schedule, batch=replace(p.job.batch, ppo_epochs=epochs))
    return replace(p, job=job, workload=job.workload())


def _full_model(problem, t):
    """The one formulation over every rollout size (what solve ran for async before split.py):
    (status, objective seconds or None)."""
    form = Formulation(problem, t)
    status, value, _, _ = solve_cpsat(form.m, form.t_hi, 60, 1, 0)
    if value is None:
        return status, None
    obj, ok, _, _ = objective(t, form.assignment(value))
    assert ok
    return status, obj


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5, 7, 11])
@pytest.mark.parametrize("schedule", (ONE_STEP, FULLY2), ids=("one_step_off", "fully_async"))
def test_split_solve_equals_the_full_model(seed, schedule):
    problem = _async(seed, schedule, epochs=1 + seed % 3 * 4)
    t = build_tables(problem)
    if any(not o for o in t.options):
        pytest.skip("a unit has no option at all")
    status, full = _full_model(problem, t)
    sol = solve(problem, backend="cpsat", time_limit_s=60, workers=1, seed=0)
    if full is None:
        assert status == "INFEASIBLE" and sol.status == "INFEASIBLE"
        return
    assert status == "OPTIMAL" and sol.status == "OPTIMAL"
    assert sol.objective == pytest.approx(full, rel=1e-9)
    assert sol.bound <= sol.objective * (1 + 1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 6])
@pytest.mark.parametrize("schedule", (ONE_STEP, FULLY2), ids=("one_step_off", "fully_async"))
def test_split_bound_never_exceeds_the_optimum_of_its_rollout_size(seed, schedule):
    """Each r's bound against that r's own optimum (its sub-problem solved without a cutoff): a bound
    above it would skip the r that holds the optimum. The bound must also bind somewhere (it is the
    pruning, not decoration): on at least one r it is within 2x of that r's optimum."""
    problem = _async(seed, schedule, epochs=1 + seed % 2 * 8)
    t = build_tables(problem)
    g = t.unit_index(GEN)
    ratios = []
    for r in sorted({o.size for o in t.options[g] if o.size < t.num_gpus}):
        tr = tables_for(t, r)
        lb = split_bound(tr, r)
        if any(not o for o in tr.options):
            assert lb == math.inf
            continue
        status, best = _full_model(problem, tr)
        assert status in ("OPTIMAL", "INFEASIBLE")
        if best is None:
            continue
        assert {o.size for o in tr.options[g]} == {r}
        assert lb <= best * (1 + 1e-9), (r, lb, best)
        ratios.append(best / lb)
    if ratios:
        assert min(ratios) < 2.0


def test_rollout_sizes_of_the_sub_problems_cover_every_plan():
    """The sub-problems' tables partition the generation options by size, and keep every trainer
    option that fits beside the rollout: the union of their plans is the full model's."""
    problem = _async(3, ONE_STEP)
    t = build_tables(problem)
    g, N = t.unit_index(GEN), t.num_gpus
    sizes = sorted({o.size for o in t.options[g] if o.size < N})
    seen = []
    for r in sizes:
        tr = tables_for(t, r)
        seen += tr.options[g]
        for u, opts in enumerate(tr.options):
            if u != g:
                assert set(opts) == {o for o in t.options[u] if o.size <= N - r}
    assert sorted(seen, key=id) == sorted((o for o in t.options[g] if o.size < N), key=id)


@pytest.mark.parametrize("schedule", (ONE_STEP, FULLY2), ids=("one_step_off", "fully_async"))
def test_inference_and_training_estimates_do_not_depend_on_the_schedule(schedule):
    """The option tables price inference and training on the job with a sync schedule and share
    them across schedules (candidates._Estimator): true only while the cost model reads the
    schedule for generation alone. Generation must differ (a dedicated pool never wakes up)."""
    from nereus.planner.cost.model import estimate
    from nereus.planner.specs import ParallelConfig

    p = _async(1, schedule)
    sync_job = replace(p.job, schedule=ScheduleSpec())
    for ms in p.job.model_stages():
        for cfg in (ParallelConfig(tp=1, dp=4), ParallelConfig(tp=2, pp=2, dp=1, micro_batch=2, zero=3, recompute=True)):
            a = estimate(p.job, p.cluster, ms, cfg, p.workload)
            b = estimate(sync_job, p.cluster, ms, cfg, p.workload)
            if ms.endswith("/generation"):
                assert a.time_s != b.time_s
            else:
                assert (a.time_s, a.resident_bytes, a.transient_bytes) == (b.time_s, b.resident_bytes, b.transient_bytes)


@pytest.mark.parametrize("seed", [1, 3, 5])
def test_placement_constraints_hold_under_the_split_solve(seed):
    """With the pools pinned (the transition-aware candidate "current pools, new configs") or every
    unit apart, the split solve's plan keeps them, and its optimum is the full model's."""
    from nereus.planner.solver import PlanConstraints

    base = _async(seed, ONE_STEP)
    first = solve(base, backend="cpsat", time_limit_s=60, workers=1, seed=0)
    if first.plan is None:
        pytest.skip("infeasible instance")
    w = base.workload.with_lengths(mean=base.workload.response_len_mean * 2)
    for cons in (PlanConstraints(fixed_placement=first.plan), PlanConstraints(placement="disaggregated")):
        problem = replace(base, workload=w, constraints=cons)
        sol = solve(problem, backend="cpsat", time_limit_s=60, workers=1, seed=0)
        t = build_tables(problem)
        status, full = _full_model(problem, t) if all(t.options) else ("INFEASIBLE", None)
        assert sol.status == status
        if full is None:
            continue
        assert sol.objective == pytest.approx(full, rel=1e-9)
        pools = {s.name: (s.first_gpu, s.gpus) for s in sol.plan.stages}
        if cons.fixed_placement is not None:
            assert pools == {s.name: (s.first_gpu, s.gpus) for s in first.plan.stages}
        else:
            assert len(set(pools.values())) == len(problem.job.roles) + 1  # one pool per decision unit


@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_split_solve_with_pulp_equals_brute_force(seed):
    """The PuLP/CBC backend runs the same sub-problems with the same cutoffs (big-M instead of
    enforcement literals): its async optimum is the brute-force oracle's. Two- and three-model
    instances only (CBC is slow on five units over sub-node pools, see the solver README)."""
    problem = _async(seed, ONE_STEP if seed % 2 else FULLY2, epochs=1 + seed % 2 * 8)
    if len(problem.job.roles) > 3:
        pytest.skip("four models: too slow for CBC")
    pu = solve(problem, backend="pulp", time_limit_s=60, workers=1, seed=0)
    bf = solve(problem, backend="brute")
    assert pu.status == bf.status
    if bf.status != "INFEASIBLE":
        assert pu.status == "OPTIMAL" and pu.objective == pytest.approx(bf.objective, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 6])
@pytest.mark.parametrize("schedule", (ONE_STEP, FULLY2), ids=("one_step_off", "fully_async"))
def test_tightening_a_rollout_size_over_its_trainer_gpus_keeps_its_optimum(seed, schedule):
    """``greedy.tighten(tables_for(t, r), upper, rest=N - r)`` (the trainer phases' GPU-seconds over
    the N - r GPUs the rollout leaves, what solve_split prunes each size with): with that size's own
    optimum as the bound the tightened sub-problem has the same optimum; 10% below it, it is lost,
    and counting the GPU-seconds over N - r prunes at least as much as over N."""
    from nereus.planner.solver.greedy import tighten

    problem = _async(seed, schedule, epochs=1 + seed % 2 * 8)
    t = build_tables(problem)
    g, N = t.unit_index(GEN), t.num_gpus
    checked = 0
    for r in sorted({o.size for o in t.options[g] if o.size < N}):
        tr = tables_for(t, r)
        if any(not o for o in tr.options):
            continue
        status, best = _full_model(problem, tr)
        if best is None:
            continue
        kept = tighten(tr, best, rest=N - r)
        assert sum(map(len, kept.options)) <= sum(map(len, tighten(tr, best).options))
        status, again = _full_model(problem, kept)
        assert status == "OPTIMAL" and again == pytest.approx(best, rel=1e-9), (r, best, again)
        cut = tighten(tr, best * 0.9, rest=N - r)
        if not any(not o for o in cut.options):
            status, worse = _full_model(problem, cut)
            assert worse is None or worse > best * (1 + 1e-9)
        checked += 1
    assert checked


LAZY_SPLIT = ("ppo-8b@64:one_step_off", "ppo-8b@64:fully_async", "ppo-70b@64:fully_async", "ppo-70b@64:one_step_off",
              "ppo-8b@256:fully_async", "ppo-70b@256:one_step_off", "grpo-7b@32:fully_async", "seed1", "seed5")


def _lazy_case(name: str):
    """An async problem: ``job@gpus:schedule`` of the example jobs (``benchmarks/table_pin._problem``)
    or ``seed<k>``, a random instance under fully_async."""
    import sys
    from pathlib import Path

    from nereus.planner.solver import candidates

    candidates._build_tables_cached.cache_clear()
    candidates._estimates.clear()
    if name.startswith("seed"):
        return _async(int(name[4:]), FULLY2)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from table_pin import _problem

    job, _, kind = name.partition(":")
    model, gpus = job.split("@")
    return _problem(f"{model}.yaml", int(gpus), schedule=ONE_STEP if kind == "one_step_off" else FULLY2)


@pytest.mark.parametrize("name", LAZY_SPLIT + ("ppo-8b@1024:one_step_off",))
def test_each_rollout_size_priced_alone_gets_the_tables_of_the_full_ones(name):
    """``price_groups(b, h, r)`` prices every group ``tighten(tables_for(full, r), h, rest=N - r)``
    keeps an option of; and a size ruled out on floors (``floor_bound``) is one whose tightened
    tables' bound reaches h."""
    from nereus.planner.solver import candidates
    from nereus.planner.solver.greedy import greedy, price_groups, tighten
    from nereus.planner.solver.split import floor_bound

    p = _lazy_case(name)
    full = build_tables(p)
    h = greedy(p, full)
    if h is None:
        pytest.skip("greedy finds no plan: solve prices every group")
    candidates._build_tables_cached.cache_clear()
    b = candidates.table_builder(p)
    greedy(p, b)
    N, ruled_out = b.num_gpus, 0
    for r in b.sizes:
        want = tighten(tables_for(full, r), h[0], rest=N - r)
        seen = []
        got = price_groups(b, h[0], rollout=r, give_up=lambda low, r=r, seen=seen: seen.append(floor_bound(b, r, low, h[0])) or False)
        mine = tighten(tables_for(got, r), h[0], rest=N - r)
        if any(not o for o in want.options):  # no plan at this size (either way split_bound is inf)
            assert any(not o for o in mine.options), r
            assert split_bound(mine, r) == math.inf
        else:
            assert mine.options == want.options, r
        for lb in seen:
            assert lb <= split_bound(want, r) * (1 + 1e-12), (r, lb)
        ruled_out += any(lb >= h[0] for lb in seen)
    assert len(b.priced) <= len(b.units) * len(b.sizes)


@pytest.mark.parametrize("name", LAZY_SPLIT + ("ppo-8b@1024:one_step_off",))
def test_solving_each_rollout_size_lazily_returns_the_plan_of_the_cluster_wide_tables(name, monkeypatch):
    """End to end: ``solve`` with ``split.solve_split_lazy`` as it is, and with it replaced by what
    solve ran before (every group ``price_groups(b, h)`` asks for priced, the tables tightened over the
    whole cluster, ``solve_split``): the same status, objective, bound and plan (the rollout size too)."""
    import importlib

    from nereus.planner.solver import candidates, split
    from nereus.planner.solver.greedy import price_groups, tighten

    S = importlib.import_module("nereus.planner.solver.solve")
    p = _lazy_case(name)

    def before(problem, b, hint, *a):
        return split.solve_split(problem, tighten(price_groups(b, hint[0]), hint[0]), hint, *a)

    fill, one = split._greedy_fill, split._solve_one
    got = []
    for old in (True, False):
        candidates._build_tables_cached.cache_clear()
        candidates._estimates.clear()
        calls = []  # the order the sizes are seeded and solved in, with the tables and cutoff of each

        def spy_fill(t, r, calls=calls):
            calls.append(("fill", r, t.options))
            return fill(t, r)

        def spy_one(problem, t, hint, upper, *a, calls=calls):
            calls.append(("solve", upper, t.options, hint and hint[0]))
            return one(problem, t, hint, upper, *a)

        monkeypatch.setattr(split, "_greedy_fill", spy_fill)
        monkeypatch.setattr(split, "_solve_one", spy_one)
        if old:
            monkeypatch.setattr(split, "solve_split_lazy", before)
        sol = S.solve(p, backend="cpsat", time_limit_s=30, workers=1, seed=0, deterministic=True)
        monkeypatch.undo()
        plan = None if sol.plan is None else {k: v for k, v in sol.plan.to_dict().items() if k != "solve_s"}
        got.append((sol.status, sol.objective, sol.bound, plan, calls))
    assert got[0] == got[1]
