"""No flapping between near-tied plans (issue 29): GRPO-8B one-step-off on 128 H100s, a flat trace
(mean ``MEAN`` = 972 tokens) with 5% noise on the observed mean and on every stage time. Two plans are
within 1% of each other (rollout pools of 112 and 96 GPUs; observed times are the planner's own
predictions, so neither is really faster): the noise flips their order from step to step. With
hysteresis switched off (patience 1, no dwell, no margin, no min_gain, no noise band) the
controller follows the flips; with it, it stays. Also the parts: the noise band of a saving, the
shape model's extrapolated noise, and patience for free switches."""
from __future__ import annotations

import math
import random

from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import compose_step, evaluate_times
from nereus.planner.online.calibration import OnlineCalibration
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.library import Candidate
from nereus.planner.online.reserve import MemoryReserves

from controller_env import env  # noqa: F401 - the scenario's module fixture
from test_controller_split import CLUSTER, JOB
from test_controller_thresholds import _const, _ctl, _metrics

OFF = dict(patience=1, min_dwell=0, margin=0.0, min_gain=0.0, confidence=0.0)
MEAN = 972.0
"""The flat trace's mean: where the two plans' predicted steps tie (0.4% apart). Pricing the
cross-pool weight sync as a broadcast with a per-tensor cost moved the tie from about 1,024 tokens
(where the plans are now 2.05% apart) to 972-976; the flip counts below are sensitive to it (968 and
980 fail them with seed 0)."""


def _flat(steps: int = 30, noise: float = 0.05, seed: int = 0, **kw) -> tuple[Controller, list[int]]:
    r = random.Random(seed)
    cap = JOB.sequence.response_len_max
    w = JOB.workload().with_lengths(mean=MEAN, max_=cap)
    # engine_restart_s=0: switching rollout pools costs only moving state here, so nothing but the
    # hysteresis stands between the controller and the noise (the engine start would bind first)
    ctl = Controller(JOB, CLUSTER, horizon=30, build_transition=False, total_steps=steps, initial_workload=w,
                     engine_restart_s=0.0, **kw)
    switched = []
    for step in range(steps):
        times = evaluate_times(JOB, CLUSTER, ctl.plan, w, ctl.base_params).stage_s
        d = ctl.step(StepMetrics(step=step, response_len_mean=MEAN * (1 + noise * r.gauss(0, 1)),
                                 response_len_max=cap, response_len_cap=cap,
                                 stage_times={k: v * (1 + noise * r.gauss(0, 1)) for k, v in times.items()}))
        if d.action == "switch":
            switched.append(step)
    return ctl, switched


def _true_s(plan) -> float:
    w = JOB.workload().with_lengths(mean=MEAN, max_=JOB.sequence.response_len_max)
    t = evaluate_times(JOB, CLUSTER, plan, w, CostParams())
    return compose_step(JOB, plan, t.stage_s, t.weight_sync_s)


def test_near_tied_plans_flap_on_noise_without_hysteresis_and_not_with_it():
    off, off_switches = _flat(**OFF)
    # the scenario has near-tied plans: the library holds plans on other rollout pools within 2% of the start
    start = _true_s(next(p for p, origin in off._library.values() if origin == "initial"))
    ties = [p for p, _ in off._library.values()
            if p.stage("actor/generation").gpus != 112 and abs(_true_s(p) / start - 1) < 0.02]
    assert ties, "no near-tied plan on another rollout pool"
    assert len(off_switches) >= 3, off_switches  # the noise flips their order, and the controller follows
    on, on_switches = _flat()
    assert len(on_switches) <= 1, (on_switches, [r["reason"] for r in on.audit.records if r["decision"] == "switch"])


def test_a_saving_within_the_noise_band_stays_and_the_band_is_zero_without_noise():
    """On the noisy trace every stay that a saving would have passed without the band says so; on
    the same trace without noise the band is 0 (a model the machine matches exactly is trusted)."""
    on, _ = _flat(steps=12)
    reasons = [r["reason"] for r in on.audit.records]
    assert any("within what measurement noise leaves uncertain" in x for x in reasons), reasons
    clean, _ = _flat(steps=8, noise=0.0)
    assert all(clean.calibration.noise(ms) == 0.0 for ms in ("actor/generation", "actor/training"))
    assert not any("measurement noise" in r["reason"] for r in clean.audit.records)


def test_a_config_never_run_inherits_the_noise_of_the_configs_the_shape_model_fitted():
    """Two configs 0.22 doublings apart along dp: a config two doublings away depends on their
    log-ratios with weights far above 1 (the slope fitted to their noise, extrapolated), of opposite
    signs; a config run depends on itself alone."""
    cal = OnlineCalibration()
    r = random.Random(1)
    for _ in range(8):
        cal.update("actor/generation", 1.0 + 0.05 * r.gauss(0, 1), 1.0, "dp14", (3.0, 0.0, math.log2(14), 0.0, 0.0, 0.0))
        cal.update("actor/generation", 1.0 + 0.05 * r.gauss(0, 1), 1.0, "dp12", (3.0, 0.0, math.log2(12), 0.0, 0.0, 0.0))
    far = cal.dependence("actor/generation", "dp48", (1.0, 0.0, math.log2(48), 0.0, 0.0, 0.0))
    assert far["dp14"] > 2 and far["dp12"] < -1, far  # dp48 lies beyond dp14, seen from dp12
    assert cal.dependence("actor/generation", "dp12", None) == {"dp12": 1.0}
    assert 0.02 < cal.noise("actor/generation") < 0.1
    assert math.isclose(cal.se("actor/generation", "dp12"), 1.2533 * cal.noise("actor/generation") / math.sqrt(8))


def test_a_free_switch_waits_for_patience_too(env):
    """A switch the transition prices at 0 (knobs, or a layout that moves no state) must win
    ``patience`` steps in a row like any other. Before, a free winner was taken at once: noise
    elected one for a step, the next step's noise another (4 of the 6 switches on the flat trace)."""
    ctl = _ctl(env, _const(0.0), initial_gpus=None, patience=2, min_dwell=0)
    cur = Candidate(ctl.plan, "current", horizon_s=1000.0, feasible_next=True, times=(20.0,) * 5)
    alt = Candidate(ctl.plan, "keep-layout", cost_s=0.0, horizon_s=900.0, feasible_next=True, times=(18.0,) * 5)
    d0 = ctl._admit(_metrics(env, 0, ctl.plan), cur, [alt], "", False)
    assert d0.action == "stay" and "1/2 steps in a row" in d0.reason, d0.reason
    d1 = ctl._admit(_metrics(env, 1, ctl.plan), cur, [alt], "", False)
    assert d1.action == "switch", d1.reason


def test_the_forecast_of_a_flat_noisy_trace_does_not_swing_and_a_ramp_keeps_its_slope():
    """5% noise on a flat mean of 1,024, 20 seeds, steps 5-20: the mean forecast 30 steps ahead is
    off by more than 10% at under 3% of the steps (before: 54%, up to 71% off; a few steps'
    Theil-Sen slope forecast 500 or 1,500 tokens, and the plans were re-ranked on it), never by a
    third; a ramp of 10 tokens per step keeps its slope."""
    from nereus.planner.online.forecast import LengthForecaster

    errs = []
    for seed in range(20):
        r, f = random.Random(seed), LengthForecaster(window=60)
        for s in range(20):
            f.observe(s, 1024 * (1 + 0.05 * r.gauss(0, 1)), 8192)
            if s >= 4:
                errs.append(abs(f.forecast(30).response_len_mean / 1024 - 1))
    assert sum(e > 0.10 for e in errs) < 0.03 * len(errs) and max(errs) < 1 / 3, sorted(errs)[-10:]
    r, f = random.Random(0), LengthForecaster(window=60)
    for s in range(20):
        f.observe(s, 1000 + 10 * s + 10 * r.gauss(0, 1), 8192)
    assert 7 < f.slope() < 13, f.slope()


def test_a_plan_that_ran_out_of_memory_carries_its_crash_rate_over_the_horizon(env):
    """A reserve that decays re-admits a struck plan the model predicts to fit; its own record (1
    OOM in 4 clean steps: 1 / 6 per step) prices the crash-restarts it is expected to cost. Before,
    a decayed reserve made it look as fast as its step time, and the controller went back to plans
    that had crashed (SIMULATED ppo-32b ramp_1024: 6 of 12 crash-restarts on plans that had crashed)."""
    from nereus.planner.online.library import trapezoid
    from nereus.planner.online.restart import restart_seconds

    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    ws, offsets = [env.w] * 3, (1, 2, 3)
    clean = Candidate(ctl.plan, "x")
    ctl._score(clean, ws, offsets)
    key = ctl.plan.key()
    ctl.memory.struck[key], ctl.memory.runs[key] = 1, 4
    assert math.isclose(ctl.memory.crash_rate(key), 1 / 6)
    struck = Candidate(ctl.plan, "x")
    ctl._score(struck, ws, offsets)
    crash = restart_seconds(ctl.job, ctl.cluster, ctl.plan, ctl.plan, ctl.restart_cost)
    t = clean.times[0]
    assert math.isclose(struck.horizon_s, trapezoid([t + (t + crash) / 6] * 3, offsets), rel_tol=1e-9)
    assert struck.horizon_s > clean.horizon_s


def test_a_config_that_ran_out_of_memory_holds_out_never_run_plans_as_hungry():
    """An OOM in actor/training on config c at a predicted peak of 70 GiB; another config's clean
    steps decay the stage reserve toward its own underestimate. A plan never run predicted at >= 70
    GiB there stays out (SIMULATED ppo-32b: decayed reserves re-admitted such plans, 12
    crash-restarts); one less hungry is judged by the reserves, the struck plan by its crash rate.
    Another config running at 75 GiB does not lift the floor; c running at 72 GiB lifts it past 72."""
    r = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    c, other = ("tp4", "mb2"), ("tp1", "mb1")
    r.oom(("a",), {"actor/training": 70.0, "actor/generation": 60.0}, "actor/training", judged_fit=True,
          configs={"actor/training": c})
    for _ in range(30):
        r.ran(("b",), {"actor/training": 40.0}, 41.0, configs={"actor/training": other})
    assert r.stage_gib("actor/training") <= 1.0  # decayed: the reserves alone would re-admit a 70 GiB plan
    assert r.hungrier(("new",), {"actor/training": 70.0})
    assert not r.hungrier(("new",), {"actor/training": 69.0})
    assert not r.hungrier(("a",), {"actor/training": 70.0})  # struck: priced by its crash rate
    r.ran(("e",), {"actor/training": 75.0}, 76.0, configs={"actor/training": other})
    assert r.hungrier(("new",), {"actor/training": 71.0})
    r.ran(("d",), {"actor/training": 72.0}, 73.0, configs={"actor/training": c})
    assert not r.hungrier(("new",), {"actor/training": 71.0}) and r.hungrier(("new",), {"actor/training": 73.0})


def test_clean_steps_before_a_plans_first_oom_do_not_dilute_its_crash_rate():
    """Responses grow in RL: a plan's clean steps before its first OOM ran shorter responses and say
    little of the rate at the lengths where it failed. 40 clean steps, then an OOM: 1 / 2 per step
    (was 1 / 42, which let a decayed reserve bring it straight back); 5 clean steps later 1 / 7; a
    second OOM 2 / 8. SIMULATED grpo-32b ramp_1024: adaptive 6 -> 4 crash-restarts."""
    r = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    key, peaks = ("p",), {"actor/training": 60.0}
    for _ in range(40):
        r.ran(key, peaks, 61.0)
    assert r.crash_rate(key) == 0.0
    r.oom(key, {**peaks, "actor/generation": 50.0}, "actor/training", judged_fit=True)
    assert math.isclose(r.crash_rate(key), 1 / 2)
    for _ in range(5):
        r.ran(key, peaks, 61.0)
    assert math.isclose(r.crash_rate(key), 1 / 7)
    r.oom(key, {**peaks, "actor/generation": 50.0}, "actor/training", judged_fit=True)
    assert math.isclose(r.crash_rate(key), 2 / 8)
    assert r.runs[key] == 45  # the plan's whole record is kept (first-run and never-run judgements)
