"""What `solve` reports beside the plan: status, objective, bound, gap, message and wall time, on
each path through it (an exact proof, a heuristic answer, a heuristic miss, a backend that runs
out of time, a joint-memory infeasibility, a transition-aware choice). Mutation testing found these
fields unchecked; each test pins one path."""
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nereus.planner.solver import PlanProblem, evaluate_plan, solve
from nereus.planner.solver.candidates import build_tables

sys.path.insert(0, str(Path(__file__).parent))
from test_solver import random_instance  # noqa: E402

solve_mod = sys.modules["nereus.planner.solver.solve"]


def _tight(seed: int = 0, memory_gib: float = 2.4) -> PlanProblem:
    """Every model-stage has configs that fit alone (non-empty option tables), but no combination
    fits at once: 1.9 GiB usable per GPU (2.4 GiB - 0.5 reserved) for instance 0 (with the measured
    memory conventions and the held-out reserve: 2.3 GiB leaves a model-stage with no config, 2.5
    fits a plan)."""
    p = random_instance(seed)
    return replace(p, cluster=replace(p.cluster, gpu=replace(p.cluster.gpu, memory_gib=memory_gib)))


def test_greedy_answers_feasible_never_faster_than_the_optimum_and_claims_no_bound():
    for seed in (0, 3, 7):
        p = random_instance(seed)
        g, b = solve(p, backend="greedy"), solve(p, backend="brute")
        assert g.status == "FEASIBLE" and g.plan is not None, (seed, g.status, g.message)
        assert math.isnan(g.bound) and math.isnan(g.gap)
        assert g.objective >= b.objective * (1 - 1e-9)
        ev = evaluate_plan(p, g.plan)
        assert ev.feasible and ev.step_time_s == pytest.approx(g.objective, rel=1e-9)
        assert g.plan.status == "FEASIBLE" and g.plan.backend == "greedy" and g.wall_s > 0


def test_joint_memory_infeasibility_is_proven_by_every_exact_backend_and_named():
    p = _tight()
    assert all(build_tables(p).options), "each model-stage fits alone: only the combination is infeasible"
    for backend in ("cpsat", "pulp", "brute"):
        s = solve(p, backend=backend, workers=1)
        assert s.status == "INFEASIBLE" and s.plan is None, (backend, s.status)
        assert s.objective == math.inf and s.bound == math.inf and math.isnan(s.gap), (backend, s.bound)
        assert "needs >=" in s.message and "GiB" in s.message and "found no plan" not in s.message, s.message
        assert s.wall_s > 0 and s.backend == backend


def test_a_greedy_miss_is_reported_infeasible_but_not_proven():
    import time

    t0 = time.perf_counter()
    s = solve(_tight(), backend="greedy")
    elapsed = time.perf_counter() - t0
    assert s.status == "INFEASIBLE" and s.plan is None and s.objective == math.inf and s.backend == "greedy"
    assert math.isnan(s.bound) and math.isnan(s.gap) and 0 < s.wall_s <= elapsed
    assert s.message.startswith("greedy found no memory-feasible plan") and s.message.endswith(
        "(not a proof; try --backend cpsat)"), s.message


def test_a_backend_without_an_answer_in_its_time_limit_falls_back_to_greedy_or_says_so(monkeypatch):
    from nereus.planner.solver import backends

    monkeypatch.setattr(backends, "solve_cpsat", lambda *a, **k: ("UNKNOWN", None, math.nan, math.nan))
    p = random_instance(7)
    fallback = solve(p, backend="cpsat", time_limit_s=7)
    g = solve(p, backend="greedy")
    assert fallback.status == "FEASIBLE" and math.isnan(fallback.bound) and math.isnan(fallback.gap)
    assert fallback.objective == pytest.approx(g.objective, rel=1e-12)
    monkeypatch.setattr(solve_mod, "greedy", lambda problem, t: None)
    none = solve(p, backend="cpsat", time_limit_s=7)
    assert none.status == "INFEASIBLE" and none.plan is None and none.objective == math.inf
    assert math.isnan(none.bound) and none.message == "cpsat found no plan within 7 s" and none.wall_s > 0


def test_the_brute_backend_enumerates_without_building_a_milp(monkeypatch):
    from nereus.planner.solver import formulation

    def no_milp(*a, **k):
        raise AssertionError("brute force built the MILP")

    monkeypatch.setattr(formulation, "Formulation", no_milp)
    p = random_instance(1)
    s = solve(p, backend="brute")
    assert s.status == "OPTIMAL" and s.bound == pytest.approx(s.objective, rel=1e-12)
    with pytest.raises(AssertionError, match="built the MILP"):
        solve(p, backend="cpsat")


def _greedy_as_current(seed: int = 7):
    """Instance 7, whose greedy plan is 0.44% slower than the optimum and laid out differently."""
    p = random_instance(seed)
    opt, cur = solve(p, backend="cpsat", workers=1), solve(p, backend="greedy").plan
    assert cur.layout_key() != opt.plan.layout_key() and cur.step_time_s > opt.objective * (1 + 1e-6)
    return p, opt, cur


def test_keeping_a_slower_layout_for_its_transition_cost_is_feasible_with_its_gap_not_optimal():
    p, opt, cur = _greedy_as_current()
    cost = lambda a, b: 0.0 if a.layout_key() == b.layout_key() else 1e6  # noqa: E731
    s = solve(replace(p, current_plan=cur, transition_cost=cost, amortize_steps=10.0), backend="cpsat", workers=1)
    assert s.plan.layout_key() == cur.layout_key() and dict(s.plan.extras)["transition_s"] == 0.0
    assert s.objective == pytest.approx(cur.step_time_s, rel=1e-9)
    # the bound is the step-time optimum's, which this objective is above: not proven
    assert s.bound == pytest.approx(opt.objective, rel=1e-9) and s.objective > s.bound
    assert s.status == "FEASIBLE" and s.plan.status == "FEASIBLE"
    assert s.gap == pytest.approx((s.objective - s.bound) / s.objective, rel=1e-9) and 0 < s.gap < 0.01
    assert s.plan.gap == s.gap and s.plan.solve_s == s.wall_s and s.plan.backend == "cpsat"


def test_a_free_switch_to_the_optimum_is_proven_optimal_and_charged_nothing():
    p, opt, cur = _greedy_as_current()
    s = solve(replace(p, current_plan=cur, transition_cost=lambda a, b: 0.0, amortize_steps=10.0), backend="cpsat",
              workers=1)
    assert s.status == "OPTIMAL" and s.plan.status == "OPTIMAL"
    assert s.gap == pytest.approx((s.objective - s.bound) / s.objective, abs=1e-12) and 0 <= s.gap < 1e-6
    assert s.objective == pytest.approx(opt.objective, rel=1e-9) and dict(s.plan.extras)["transition_s"] == 0.0


def test_a_current_plan_without_amortization_steps_is_ignored():
    p, opt, cur = _greedy_as_current()
    s = solve(replace(p, current_plan=cur, transition_cost=lambda a, b: 1e6, amortize_steps=0.0), backend="cpsat",
              workers=1)
    assert s.plan.layout_key() == opt.plan.layout_key() and "transition_s" not in dict(s.plan.extras)
    assert s.status == "OPTIMAL" and s.objective == pytest.approx(opt.objective, rel=1e-12)


def test_the_reported_bound_is_the_backends_not_the_objective(monkeypatch):
    """An OPTIMAL answer reports the backend's proven bound (here lowered by 1e-7, still a valid
    bound), so a gap between the two is visible instead of being overwritten by the objective."""
    from nereus.planner.solver import backends

    real = backends.solve_cpsat

    def lower_bound(*a, **k):
        status, value, bound, obj = real(*a, **k)
        return status, value, bound * (1 - 1e-7), obj

    monkeypatch.setattr(backends, "solve_cpsat", lower_bound)
    s = solve(random_instance(1), backend="cpsat", workers=1)
    assert s.status == "OPTIMAL" and s.bound < s.objective
    assert s.bound == pytest.approx(s.objective * (1 - 1e-7), rel=1e-8)
    assert s.gap == pytest.approx(1e-7, rel=0.05) and s.plan.gap == s.gap  # the gap follows the bound


def test_a_plain_solve_reports_its_wall_time_and_gap_in_the_plan_too():
    import time

    t0 = time.perf_counter()
    s = solve(random_instance(1), backend="cpsat", workers=1)
    elapsed = time.perf_counter() - t0
    assert 0 < s.wall_s <= elapsed and s.plan.solve_s == s.wall_s
    assert s.plan.status == s.status == "OPTIMAL" and s.plan.gap == s.gap
    assert s.gap == pytest.approx((s.objective - s.bound) / s.objective, abs=1e-12) and 0 <= s.gap < 1e-6
    assert s.plan.backend == s.backend == "cpsat"


@pytest.mark.parametrize("backend", ["cpsat", "pulp", "greedy", "brute"])
def test_a_fixed_placement_keeps_every_pool_where_the_given_plan_has_it(backend):
    """Instance 6's optimum puts the actor on GPUs 0-3 and the critic on 4-7; pinned the other way
    round, every backend re-tunes the configs inside those very GPU ranges. (Bug found here: the
    exact backends swapped them back, the MILP's slot numbering read against the skeleton's.)
    Instance 2 had that split until the cost model priced the log-softmax pass over the vocabulary
    (``logprob_vocab_s``); its optimum now colocates them on 8 GPUs."""
    from nereus.planner.solver import PlanConstraints

    p = random_instance(6)
    opt = solve(p, backend="cpsat", workers=1).plan
    where = {s.name: (s.first_gpu, s.gpus) for s in opt.stages}
    assert where["actor/training"] == (0, 4) and where["critic/training"] == (4, 4), where
    swap = {0: 4, 4: 0}
    pinned = replace(opt, stages=tuple(replace(s, first_gpu=swap.get(s.first_gpu, s.first_gpu) if s.gpus == 4 else
                                               s.first_gpu) for s in opt.stages))
    s = solve(replace(p, constraints=PlanConstraints(fixed_placement=pinned)), backend=backend, workers=1)
    assert s.status == ("FEASIBLE" if backend == "greedy" else "OPTIMAL")
    assert {x.name: (x.first_gpu, x.gpus) for x in s.plan.stages} == {x.name: (x.first_gpu, x.gpus)
                                                                      for x in pinned.stages}
    assert s.objective == pytest.approx(opt.step_time_s, rel=1e-9)  # a mirror image costs the same


@pytest.mark.parametrize("backend", ["cpsat", "pulp"])
def test_the_milp_objective_is_the_step_time_recomputed_from_its_plan(backend, monkeypatch):
    """The objective the exact backend optimised (its own number, before solve recomputes the step
    time from the chosen options) equals that step time: the linear model prices plans as the cost
    tables do, weight sync included, so its optimum is the plans' optimum."""
    from nereus.planner.solver import backends

    seen = []
    real = getattr(backends, f"solve_{backend}")

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out[3])
        return out

    monkeypatch.setattr(backends, f"solve_{backend}", spy)
    for seed in (1, 2, 7):
        s = solve(random_instance(seed), backend=backend, workers=1)
        assert s.status == "OPTIMAL"
        assert seen[-1] == pytest.approx(s.objective, rel=1e-6), (seed, seen[-1], s.objective)


def test_re_tuning_inside_the_current_pools_is_a_candidate_when_moving_pools_costs_too_much():
    """Instance 13: the greedy plan re-tuned inside its own pools is faster than itself, and only
    the optimum's different pools cost a transition here. The transition-aware solve must find the
    re-tuned plan (it keeps every model where it is). (Instance 3 had that shape until the cost
    model priced the log-softmax pass over the vocabulary, instance 11 until greedy tried the
    nested split templates; both greedy plans are now in the optimum's pools.)"""
    from nereus.planner.solver import PlanConstraints

    p = random_instance(13)
    cur = solve(p, backend="greedy").plan
    retuned = solve(replace(p, constraints=PlanConstraints(fixed_placement=cur)), backend="cpsat", workers=1)
    opt = solve(p, backend="cpsat", workers=1)
    assert opt.objective < retuned.objective < cur.step_time_s * (1 - 1e-6)

    def pools(plan):
        return {(x.name, x.first_gpu, x.gpus) for x in plan.stages}

    cost = lambda a, b: 0.0 if pools(a) == pools(b) else 1e6  # noqa: E731
    s = solve(replace(p, current_plan=cur, transition_cost=cost, amortize_steps=10.0), backend="cpsat", workers=1)
    assert pools(s.plan) == pools(cur) and s.plan.layout_key() != cur.layout_key()
    assert s.objective == pytest.approx(retuned.objective, rel=1e-9)


def test_a_transition_aware_solve_of_an_infeasible_job_reports_it_infeasible():
    """Nothing fits the tight cluster, the current plan included: no candidate, the step-time
    answer (INFEASIBLE, proven) is returned as it is."""
    cur = solve(random_instance(0), backend="greedy").plan
    s = solve(replace(_tight(), current_plan=cur, transition_cost=lambda a, b: 1.0, amortize_steps=5.0),
              backend="cpsat", workers=1)
    assert s.status == "INFEASIBLE" and s.plan is None and s.bound == math.inf and "needs >=" in s.message


def test_an_unknown_backend_is_a_spec_error_naming_the_choices():
    from nereus.errors import SpecError

    with pytest.raises(SpecError, match=r"unknown solver backend 'simplex'; choose one of \('cpsat', 'pulp'"):
        solve(random_instance(1), backend="simplex")


def test_re_tuning_the_current_pools_is_a_candidate_of_the_transition_aware_solve():
    """Moving pools costs 1e6 s, re-tuning configs on the current pools nothing: the answer is the
    best plan on the current pools (instance 5: 0.006% faster than the current plan), not the
    current plan itself and not the step-time optimum elsewhere."""
    p, opt, cur = _greedy_as_current(5)

    def pools(plan):
        return tuple((s.name, s.first_gpu, s.gpus) for s in plan.stages)

    retuned = solve(replace(p, constraints=replace(p.constraints, fixed_placement=cur)), backend="cpsat", workers=1)
    assert pools(retuned.plan) == pools(cur) and retuned.objective < cur.step_time_s * (1 - 1e-6)
    cost = lambda a, b: 0.0 if pools(a) == pools(b) else 1e6  # noqa: E731
    s = solve(replace(p, current_plan=cur, transition_cost=cost, amortize_steps=10.0), backend="cpsat", workers=1)
    assert pools(s.plan) == pools(cur) and s.objective == pytest.approx(retuned.objective, rel=1e-9)


def test_the_transition_aware_re_solve_keeps_the_callers_limit_seed_and_determinism(monkeypatch):
    from nereus.planner.solver import backends

    calls = []
    real = backends.solve_cpsat

    def spy(m, t_hi, time_limit_s, workers, seed, deterministic=False):
        calls.append((time_limit_s, workers, seed, deterministic))
        return real(m, t_hi, time_limit_s, workers, seed, deterministic)

    p, _, cur = _greedy_as_current()
    monkeypatch.setattr(backends, "solve_cpsat", spy)
    solve(replace(p, current_plan=cur, transition_cost=lambda a, b: 1.0, amortize_steps=10.0), backend="cpsat",
          time_limit_s=7.5, workers=1, seed=3, deterministic=True)
    assert len(calls) == 2 and set(calls) == {(7.5, 1, 3, True)}, calls  # the step-time solve and the fixed-pools one


def test_a_backend_that_finds_nothing_in_time_reports_its_own_wall_time(monkeypatch):
    from nereus.planner.solver import backends

    monkeypatch.setattr(backends, "solve_cpsat", lambda *a, **k: ("UNKNOWN", None, math.nan, math.nan))
    import importlib
    import time

    monkeypatch.setattr(importlib.import_module("nereus.planner.solver.solve"), "greedy", lambda problem, t: None)

    t0 = time.perf_counter()
    s = solve(random_instance(1), backend="cpsat", workers=1, time_limit_s=3)
    elapsed = time.perf_counter() - t0
    assert s.status == "INFEASIBLE" and "found no plan within 3 s" in s.message
    assert 0 < s.wall_s <= elapsed


def test_every_answer_reports_its_backend_wall_time_and_gap_on_every_path(monkeypatch):
    """The fields beside the plan, on the paths the full mutation run found unchecked: the default
    backend, the transition-aware answer (proven and not), a model-stage that fits nowhere alone,
    and a backend that found nothing in time."""
    import importlib
    import time

    t0 = time.perf_counter()
    s = solve(random_instance(1), workers=1)  # the default backend
    assert s.backend == s.plan.backend == "cpsat" and 0 < s.wall_s <= time.perf_counter() - t0
    p, opt, cur = _greedy_as_current()
    for cost, proven in ((lambda a, b: 0.0, True), (lambda a, b: 0.0 if a.layout_key() == b.layout_key() else 1e6,
                                                   False)):
        t0 = time.perf_counter()
        s = solve(replace(p, current_plan=cur, transition_cost=cost, amortize_steps=10.0), backend="cpsat", workers=1)
        elapsed = time.perf_counter() - t0
        assert s.backend == s.plan.backend == "cpsat" and 0 < s.wall_s <= elapsed and s.plan.solve_s == s.wall_s
        assert (s.status, s.gap == 0.0) == (("OPTIMAL", True) if proven else ("FEASIBLE", False)), (s.status, s.gap)
    # a model-stage that fits no GPU on its own: INFEASIBLE before any backend runs
    tiny = replace(_tight(), cluster=_tight().cluster.with_gpus(1))
    t0 = time.perf_counter()
    s = solve(tiny, backend="pulp", workers=1)
    assert s.status == "INFEASIBLE" and s.backend == "pulp" and 0 < s.wall_s <= time.perf_counter() - t0
    # a backend that found nothing within its limit: gap NaN, named backend
    from nereus.planner.solver import backends

    monkeypatch.setattr(backends, "solve_cpsat", lambda *a, **k: ("UNKNOWN", None, math.nan, math.nan))
    monkeypatch.setattr(importlib.import_module("nereus.planner.solver.solve"), "greedy", lambda problem, t: None)
    s = solve(random_instance(1), backend="cpsat", workers=1, time_limit_s=2)
    assert s.backend == "cpsat" and math.isnan(s.gap) and math.isnan(s.bound) and s.objective == math.inf
