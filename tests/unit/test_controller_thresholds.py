"""Online controller at its thresholds: every admission rule is pushed to just above and just below
its limit, or switched off, and the decision has to change.

The scenario: GRPO-7B on a 4-node cluster (32 GPUs) whose job starts on 8 GPUs. From step 0 on it
may use 32 (``gpus_available=32``, a regime change, so hysteresis does not apply). The solver
offers two 32-GPU plans: the fastest ("best-horizon") and the initial layout stretched to 32 GPUs
("keep-layout", slower). Transition costs come from a function the test controls
(``transition_cost_fn``), and observed stage times come from the simulator's ground truth.
Thresholds are computed from the controller's own numbers (``Decision.saving_per_step_s``,
``break_even_steps``, ``predicted_cost_s`` and the audit record), never copied from it.
"""
from __future__ import annotations

import math

import pytest

from nereus.planner.online.calibration import OnlineCalibration
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.plan_cache import tp_pp_of

from controller_env import env  # noqa: F401 - the scenario's module fixture

H = 50
"""Horizon in steps (no ``total_steps``, so every decision looks H steps ahead)."""


def _ctl(env, cost_fn, **kw) -> Controller:
    kw.setdefault("initial_gpus", 8)
    return Controller(env.job, env.cluster, transition_cost_fn=cost_fn, horizon=H, plans=env.plans,
                      build_transition=False, **kw)


def _metrics(env, step: int, plan, gpus: int = 32, oom: bool | None = None,
             scale: dict[str, float] | None = None) -> StepMetrics:
    obs = env.gt.observe(plan, env.w, step)
    times = {ms: t * (scale or {}).get(ms, 1.0) for ms, t in obs.stage_s.items()}
    return StepMetrics(step=step, response_len_mean=env.w.response_len_mean, response_len_max=env.w.response_len_max,
                       stage_times=times, gpus_available=gpus, oom=(not obs.feasible) if oom is None else oom)


def _const(c: float):
    return lambda a, b: c


def _saving(ctl: Controller) -> float:
    """Horizon saving of the fastest candidate in the last audit record (every candidate pays the
    same constant transition cost, so the fastest is the one the controller weighs)."""
    rec = ctl.audit.records[-1]
    return rec["current_horizon_s"] - min(c["horizon_s"] for c in rec["candidates"] if c["horizon_s"] is not None)


# ---- admission: saving over the horizon vs transition cost x (1 + margin) ------------------------
@pytest.mark.parametrize("margin", (0.0, 0.25, 1.0))
def test_switch_is_admitted_just_below_break_even_cost_and_refused_just_above(env, margin):
    probe = _ctl(env, _const(1e9), margin=margin)
    d = probe.step(_metrics(env, 0, probe.plan))
    assert d.action == "stay" and not d.must and "does not repay" in d.reason, d.reason
    saving = _saving(probe)
    assert saving > 0
    # the decision's own fields say the same: saving per step over H steps, break-even = cost / saving per step
    assert d.saving_per_step_s * H == pytest.approx(saving, rel=1e-9)
    assert d.predicted_cost_s == 1e9 and d.break_even_steps == pytest.approx(1e9 / d.saving_per_step_s, rel=1e-9)
    break_even_cost = saving / (1 + margin)

    below = _ctl(env, _const(0.99 * break_even_cost), margin=margin)
    d_below = below.step(_metrics(env, 0, below.plan))
    assert _saving(below) == pytest.approx(saving, rel=1e-9)  # same question, same numbers
    assert d_below.action == "switch", d_below.reason
    assert d_below.predicted_cost_s == pytest.approx(0.99 * break_even_cost)
    assert d_below.break_even_steps * (1 + margin) < H
    assert below.plan is d_below.plan and d_below.plan.num_gpus == 32

    above = _ctl(env, _const(1.01 * break_even_cost), margin=margin)
    d_above = above.step(_metrics(env, 0, above.plan))
    assert d_above.action == "stay" and "does not repay" in d_above.reason, d_above.reason
    assert d_above.predicted_cost_s == pytest.approx(1.01 * break_even_cost)
    assert d_above.break_even_steps * (1 + margin) > H
    assert above.plan.num_gpus == 8


def test_min_gain_refuses_savings_below_its_fraction_of_the_horizon(env):
    probe = _ctl(env, _const(1.0))
    assert probe.step(_metrics(env, 0, probe.plan)).action == "switch"
    frac = _saving(probe) / probe.audit.records[-1]["current_horizon_s"]
    assert 0 < frac < 1
    d_off = (c := _ctl(env, _const(1.0), min_gain=1.01 * frac)).step(_metrics(env, 0, c.plan))
    assert d_off.action == "stay" and "within model error" in d_off.reason, d_off.reason
    d_on = (c := _ctl(env, _const(1.0), min_gain=0.99 * frac)).step(_metrics(env, 0, c.plan))
    assert d_on.action == "switch", d_on.reason


# ---- hysteresis: a second worthwhile switch right after the first ---------------------------------
def _two_step_costs(second: float):
    """8 GPUs -> keep-layout costs 10 s, 8 GPUs -> anything else 1e6 s (so step 0 lands on the
    stretched layout), and keep-layout -> the fastest plan costs ``second``."""
    def cost(a, b):
        if tp_pp_of(a) == tp_pp_of(b):
            return 10.0
        return 1e6 if a.num_gpus == 8 else second

    return cost


def _run(env, steps: int, second: float, report=None, **kw):
    """Decisions of ``steps`` steps; ``report(d0)`` is the measured time of step 0's transition."""
    ctl = _ctl(env, _two_step_costs(second), **kw)
    start = ctl.plan
    out = []
    for s in range(steps):
        d = ctl.step(_metrics(env, s, ctl.plan))
        if s == 0:
            assert d.action == "switch" and d.predicted_cost_s == 10.0, d.reason  # onto the stretched layout
            assert "keep-layout" in d.reason and tp_pp_of(d.plan) == tp_pp_of(start), d.reason
            if report is not None:
                ctl.report_transition(report(d))
        out.append(d)
    return ctl, out


def _switch_steps(ds) -> list[int]:
    return [i for i, d in enumerate(ds) if d.action == "switch"]


@pytest.mark.parametrize("min_dwell,expected", [(5, 5), (3, 3), (1, 2)])  # with 1 the patience of 2 binds
def test_min_dwell_delays_the_next_switch_by_exactly_min_dwell_steps(env, min_dwell, expected):
    ctl, ds = _run(env, expected + 1, second=10.0, min_dwell=min_dwell, patience=2)
    assert _switch_steps(ds) == [0, expected], [d.reason for d in ds]
    for d in ds[1:min_dwell]:
        assert f"within {min_dwell} steps of the last switch" in d.reason, d.reason
    assert ds[expected].predicted_cost_s == 10.0 and "best-horizon" in ds[expected].reason


@pytest.mark.parametrize("patience", (1, 2, 4))
def test_patience_requires_the_same_winner_that_many_steps_in_a_row(env, patience):
    ctl, ds = _run(env, patience + 1, second=10.0, min_dwell=0, patience=patience)
    assert _switch_steps(ds) == [0, patience], [d.reason for d in ds]
    for k in range(1, patience):
        assert f"worth it {k}/{patience} steps in a row" in ds[k].reason, ds[k].reason


# ---- transition-time factor: report_transition calibrates later cost predictions ------------------
def _step1(env, second: float, report=None):
    """Step 1's decision (keep-layout -> fastest plan costs ``second``), hysteresis off."""
    ctl, ds = _run(env, 2, second=second, report=report, min_dwell=0, patience=1)
    return ctl, ds[1]


@pytest.fixture(scope="module")
def step1_saving(env):
    """Horizon saving of the keep-layout -> fastest switch at step 1, from a run that never takes it."""
    ctl, d = _step1(env, 1e9)
    assert d.action == "stay" and "does not repay" in d.reason, d.reason
    s = _saving(ctl)
    assert s > 0 and d.saving_per_step_s * H == pytest.approx(s, rel=1e-9)
    return s / (1 + ctl.margin)  # the break-even transition cost


def test_report_transition_scales_later_transition_costs_and_decisions(env, step1_saving):
    cheap, dear = 0.5 * step1_saving, 1.5 * step1_saving
    # half the break-even cost repays the move ...
    _, d = _step1(env, cheap)
    assert d.action == "switch" and d.predicted_cost_s == pytest.approx(cheap), d.reason
    # ... unless the first transition took 3x its prediction: then every later cost is 3x
    ctl, d = _step1(env, cheap, report=lambda d0: 3.0 * d0.predicted_cost_s)
    assert d.action == "stay" and "does not repay" in d.reason, d.reason
    assert d.predicted_cost_s == pytest.approx(3 * cheap)
    assert ctl.calibration.transition_factor() == pytest.approx(3.0)
    assert ctl.audit.records[-1]["calibration"]["transition"] == pytest.approx(3.0)
    assert ctl.transition_cost(d.plan, d.plan) == 0.0  # staying stays free
    # and the other way: 1.5x break-even does not repay, a transition measured at half its prediction does
    _, d = _step1(env, dear)
    assert d.action == "stay", d.reason
    _, d = _step1(env, dear, report=lambda d0: 0.5 * d0.predicted_cost_s)
    assert d.action == "switch" and d.predicted_cost_s == pytest.approx(0.5 * dear), d.reason


def test_transition_time_factor_is_clamped_to_the_calibration_bounds(env, step1_saving):
    lo, hi = OnlineCalibration().bounds
    ctl, d = _step1(env, 7.0, report=lambda d0: 1000.0 * d0.predicted_cost_s)
    assert ctl.calibration.transition_factor() == hi and d.predicted_cost_s == pytest.approx(7.0 * hi)
    # a transition reported as nearly free cannot make the next one cheaper than lo x its estimate:
    # at 1.5x break-even after the clamp it still does not repay (unclamped, 1e-4x would)
    raw = 1.5 * step1_saving / lo
    ctl, d = _step1(env, raw, report=lambda d0: 1e-4 * d0.predicted_cost_s)
    assert ctl.calibration.transition_factor() == lo
    assert d.predicted_cost_s == pytest.approx(raw * lo)
    assert d.action == "stay" and "does not repay" in d.reason, d.reason


# ---- calibration bounds: one broken measurement cannot make a stage take forever ----------------
def test_calibration_clamp_bounds_a_broken_measurement_and_its_decision(env):
    broken = {"actor/generation": 1000.0}  # a stuck step reports generation 1000x too slow
    probe = _ctl(env, _const(1e9))
    probe.step(_metrics(env, 0, probe.plan, scale=broken))
    lo, hi = probe.calibration.bounds
    assert probe.calibration.factor("actor/generation") == hi
    saving = _saving(probe)  # what the bounded factor makes the switch worth
    cost = 1.2 * saving / (1 + probe.margin)

    bounded = _ctl(env, _const(cost))
    d = bounded.step(_metrics(env, 0, bounded.plan, scale=broken))
    assert d.action == "stay" and "does not repay" in d.reason, d.reason
    # the same measurement with the clamp opened wide: the factor follows it and the switch pays
    wide = _ctl(env, _const(cost))
    wide.calibration = OnlineCalibration(bounds=(lo, 1e4))
    d = wide.step(_metrics(env, 0, wide.plan, scale=broken))
    assert wide.calibration.factor("actor/generation") > 100 * hi
    assert d.action == "switch", d.reason
    # a looser upper bound (10 instead of 4) is enough to flip the decision too
    looser = _ctl(env, _const(cost))
    looser.calibration = OnlineCalibration(bounds=(lo, 10.0))
    d = looser.step(_metrics(env, 0, looser.plan, scale=broken))
    assert looser.calibration.factor("actor/generation") == 10.0 and d.action == "switch", d.reason


def test_calibration_factors_are_medians_clamped_to_bounds():
    assert OnlineCalibration().bounds == (0.25, 4.0)  # the controller's default clamp
    cal = OnlineCalibration(window=5, bounds=(0.25, 4.0))
    cal.update("actor/generation", 1000.0, 1.0)
    cal.update("ref/inference", 1e-4, 1.0)
    assert cal.factor("actor/generation") == 4.0 and cal.factor("ref/inference") == 0.25
    for r in (1.5, 1.6, 1.4, 50.0):  # the median of the window ignores the outlier
        cal.update("actor/training", r, 1.0, config="cfg")
    assert cal.factor("actor/training", "cfg") == pytest.approx(1.55)
    assert cal.factor("actor/training", "never-run") == pytest.approx(1.55)  # model-stage fallback
    for bad in (0.0, -1.0, math.inf, math.nan):  # unusable observations change nothing
        cal.update("critic/training", bad, 1.0)
    assert cal.factor("critic/training") == 1.0
    cal.update_transition(100.0, 1.0)
    assert cal.transition_factor() == 4.0
    cal2 = OnlineCalibration(bounds=(0.25, 4.0))
    cal2.update_transition(1.0, 100.0)
    assert cal2.transition_factor() == 0.25


# ---- must-switch ---------------------------------------------------------------------------------
def test_unpredicted_oom_forces_a_must_switch_off_the_failed_plan(env):
    """At step 1 on the stretched layout, the only faster plan costs 1e5 s to reach, so the
    controller stays (control run). An OOM the model did not predict makes leaving a must: the
    controller then takes the candidate with the lowest transition + horizon time (here the failed
    layout with knobs that fit the memory reserve the OOM taught, at no transition cost), and not the
    fastest plan."""
    _, control = _run(env, 2, second=1e5)
    assert control[1].action == "stay" and "does not repay" in control[1].reason, control[1].reason
    ctl = _ctl(env, _two_step_costs(1e5))
    d0 = ctl.step(_metrics(env, 0, ctl.plan))
    failed = d0.plan
    assert ctl.predict(failed, env.w)[1] and env.gt.times(failed, env.w).feasible  # nobody saw it coming
    d1 = ctl.step(_metrics(env, 1, failed, oom=True))
    assert d1.must and d1.action == "switch", d1.reason
    assert "ran out of memory" in d1.reason
    assert d1.plan.key() != failed.key() and ctl.plan is d1.plan
    rec = ctl.audit.records[-1]
    assert rec["must"] is True
    cands = [c for c in rec["candidates"] if c["horizon_s"] is not None and c["transition_s"] is not None]
    assert len(cands) >= 2, cands
    fastest = min(cands, key=lambda c: c["horizon_s"])
    cheapest_total = min(cands, key=lambda c: c["horizon_s"] + c["transition_s"])
    assert fastest is not cheapest_total  # the two rules disagree here ...
    assert rec["plan"] == cheapest_total["layout"]  # ... and the total wins
    assert d1.predicted_cost_s == cheapest_total["transition_s"] < fastest["transition_s"]


def test_repeated_oom_on_the_solvers_own_optimum_moves_off_that_plan(env):
    """Was a bug: an OOM on the solver's own optimum left the controller there (the solver proposed
    it again and it was excluded as 'current'). The OOM now teaches a memory reserve and marks the
    plan out, so the controller moves."""
    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    start = ctl.plan
    ds = [ctl.step(_metrics(env, 0, ctl.plan))]
    for s in range(1, 4):
        ds.append(ctl.step(_metrics(env, s, ctl.plan, oom=True)))
    assert all(d.must for d in ds[1:])
    assert any(d.action == "switch" and d.plan.key() != start.key() for d in ds[1:]), \
        [(d.action, d.feasible, d.reason) for d in ds]


def test_gpus_shrinking_from_32_to_8_forces_a_replan_onto_at_most_8_gpus(env):
    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    assert ctl.plan.num_gpus == 32
    d0 = ctl.step(_metrics(env, 0, ctl.plan, gpus=32))
    assert d0.action == "stay" and not d0.must
    d1 = ctl.step(_metrics(env, 1, ctl.plan, gpus=8))
    assert d1.must and d1.action == "switch" and d1.feasible, d1.reason
    assert "only 8 available" in d1.reason
    assert d1.plan.num_gpus <= 8 and ctl.plan is d1.plan
    assert d1.predicted_cost_s == 5.0
    assert env.gt.times(d1.plan, env.w).feasible  # the new plan really runs on 8 GPUs
    for s in (2, 3):  # and the controller stays within the 8 GPUs it has
        d = ctl.step(_metrics(env, s, ctl.plan, gpus=8))
        assert not d.must and d.plan.num_gpus <= 8, d.reason


# ---- ground truth -------------------------------------------------------------------------------
def test_switch_lowers_ground_truth_step_time_compared_to_staying(env):
    gt, w = env.gt, env.w
    ctl = _ctl(env, _const(30.0))
    old = ctl.plan
    d = ctl.step(_metrics(env, 0, old))
    assert d.action == "switch", d.reason
    new_s, old_s = gt.times(d.plan, w).step_s, gt.times(old, w).step_s
    assert new_s < 0.95 * old_s, (new_s, old_s)
    # the real transition included, the switch pays for itself within the horizon
    assert H * new_s + gt.transition_s(old, d.plan) < H * old_s
    # ten simulated steps: adaptive (with its transition) beats the run that stays on 8 GPUs
    static = _ctl(env, _const(1e9))
    totals = {}
    for name, c in (("adaptive", _ctl(env, _const(30.0))), ("static", static)):
        total = 0.0
        for s in range(10):
            before = c.plan
            total += gt.step_s(c.plan, w, s)
            dd = c.step(_metrics(env, s, c.plan))
            total += gt.transition_s(before, dd.plan)
        totals[name] = total
    assert totals["adaptive"] < 0.95 * totals["static"], totals


# ---- a current plan predicted to run out of memory later in the horizon ---------------------------
def test_plan_predicted_to_fail_later_is_left_when_the_alternative_repays_before_the_failure(env):
    """The current plan runs next step but not at the later forecast points (its horizon time is
    infinite). The alternative is compared with it over the steps it still runs: taken when that
    saving, plus min_gain of that time (model error), repays the transition, otherwise the current
    plan stays until the must-switch. (Before, the infinite horizon made every saving look like
    model noise, and such a plan was never left.) A free move (cost 0) to a plan that fits the
    whole horizon is taken at once, even a slower one: the failure forecast is the memory model's."""
    from nereus.planner.online.library import Candidate as _Candidate, trapezoid as _trapezoid

    ctl = _ctl(env, _const(1.0))
    offsets = ctl._offsets(0)
    assert len(offsets) >= 3
    cur_times = (10.0, 10.0) + (math.inf,) * (len(offsets) - 2)
    fast = (5.0,) * len(offsets)
    cur = _Candidate(ctl.plan, "current", horizon_s=math.inf, feasible_next=True, times=cur_times)
    cur_before = _trapezoid(cur_times[:2], offsets[:2])
    before = cur_before - _trapezoid(fast[:2], offsets[:2])
    assert before > 0
    # the break-even transition: the saving before the failure plus min_gain of that time (model error)
    even = (before + ctl.min_gain * cur_before) / (1 + ctl.margin)
    m = _metrics(env, 0, ctl.plan, gpus=8)
    for cost, action in ((0.99 * even, "switch"), (1.01 * even, "stay")):
        alt = _Candidate(env.plans.best(ctl.rule, env.w, 8, ctl.base_params), "best-horizon", cost_s=cost,
                         horizon_s=_trapezoid(fast, offsets), feasible_next=True, times=fast)
        d = ctl._admit(m, cur, [alt], "", True)
        assert d.action == action, d.reason
        assert "predicted out of memory within" in d.reason, d.reason
    slower = tuple(t * 1.05 for t in cur_times[:2]) + (5.0,) * (len(offsets) - 2)  # slower before, fits after
    free = _Candidate(ctl.plan, "keep-layout", cost_s=0.0, horizon_s=_trapezoid(slower, offsets), feasible_next=True,
                      times=slower)
    d = ctl._admit(m, cur, [free], "", True)
    assert d.action == "switch", d.reason
