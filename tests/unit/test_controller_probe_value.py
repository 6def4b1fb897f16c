"""Probes priced by what they are expected to gain, and their way back (issue 29): a probe goes to a
config never run when its expected saving under the shape model's doubt, less the risk of a crash
on its first step, pays for a round trip; once measured slower it returns, conclusively at once
or on the measured means after ``min_dwell`` steps. SIMULATED ground truth (GRPO-8B on one H200
node, ``test_shape_calibration``'s world), with the probed plan's measured times scaled."""
from __future__ import annotations

import math

import pytest

from nereus.planner.online.admission import expected_gain
from nereus.planner.online.controller import Controller, StepMetrics

from test_shape_calibration import _gen_tp, _misranking_start, world  # noqa: F401 - the module fixture


def test_expected_gain_is_the_mean_of_the_kept_saving():
    sd = 100.0
    assert expected_gain(0.0, sd) == pytest.approx(sd / math.sqrt(2 * math.pi))
    assert expected_gain(500.0, sd) == pytest.approx(500.0, rel=1e-4)  # sure to win: the saving itself
    assert 0 < expected_gain(-50.0, sd) < 0.2 * sd  # predicted 0.5 sd slower: a fifth of an sd, not sd - 50
    assert expected_gain(-50.0, 0.0) == 0.0 and expected_gain(30.0, 0.0) == 30.0
    # monotone in both
    assert expected_gain(-50.0, sd) < expected_gain(-40.0, sd) < expected_gain(-40.0, 2 * sd)


def _run(world, slow: float, steps: int, first_only: bool = False, **kw):
    """The mis-ranking start; the probed plans' measured stage times x ``slow`` (only their first
    step with ``first_only``). Returns (controller, per step (generation TP, decision reason))."""
    w, gt = world
    start = _misranking_start(world)
    ctl = Controller(start.job, start.cluster, params=start.base_params, time_limit_s=2, build_transition=False,
                     horizon=100, total_steps=100, initial_plan=start.plan, **kw)
    tp0, out, on_probe = _gen_tp(start.plan), [], 0
    for step in range(steps):
        obs = gt.observe(ctl.plan, step)
        probing = _gen_tp(ctl.plan) != tp0
        on_probe = on_probe + 1 if probing else 0
        f = slow if probing and (on_probe == 1 or not first_only) else 1.0
        d = ctl.step(StepMetrics(step=step, response_len_mean=obs.response_len_mean,
                                 response_len_max=obs.response_len_max,
                                 stage_times={k: v * f for k, v in obs.stage_s.items()},
                                 peak_mem_gib=obs.peak_mem_gib, gpus_available=8, response_len_cap=8192))
        out.append((_gen_tp(ctl.plan), d.action, d.reason))
    return ctl, tp0, out


def _probe_steps(out) -> list[int]:
    return [i for i, (_, a, r) in enumerate(out) if a == "switch" and r.startswith("probe:")]


def test_a_probe_measured_far_slower_returns_after_two_steps(world):
    """Two steps: the first that gives the probed config's noise (its own spread)."""
    ctl, tp0, out = _run(world, slow=3.0, steps=6)
    p = _probe_steps(out)[0]
    assert out[p + 1][0] != tp0, out
    tp, action, reason = out[p + 2]
    assert action == "switch" and tp == tp0, out
    assert reason.startswith("probe measured: the plan it left saves") and "of noise (3 se) after 2 steps" in reason, reason


def test_a_probe_measured_a_little_slower_returns_after_min_dwell_steps(world, monkeypatch):
    """The probed TP, about 20% faster than the start on the ground truth, measured 1.38x that: a few
    per cent slower than the start, inside what the noise band leaves uncertain for 5 steps."""
    ctl, tp0, out = _run(world, slow=1.38, steps=12)
    p = _probe_steps(out)[0]
    back = next(i for i in range(p + 1, len(out)) if out[i][1] == "switch")
    assert back == p + ctl.min_dwell and out[back][0] == tp0, out
    assert f"after {ctl.min_dwell} steps on it" in out[back][2], out[back][2]
    # without the way back, the controller's ordinary rules keep the slower probed plan longer
    monkeypatch.setattr(Controller, "_probe_return", lambda self, *a: None)
    _, _, off = _run(world, slow=1.38, steps=12)
    q = _probe_steps(off)[0]
    assert all(tp != tp0 for tp, _, _ in off[q:q + ctl.min_dwell + 1]), off


def test_one_slow_first_step_on_a_probe_is_not_a_measurement(world):
    """The probed plan's first step measured 1.5x (slower than the start), then as the truth has it
    (about 20% faster): no return on that step, and the probe is kept."""
    ctl, tp0, out = _run(world, slow=1.5, steps=10, first_only=True)
    p = _probe_steps(out)[0]
    assert all(tp != tp0 for tp, _, _ in out[p:]), out


def test_a_first_step_that_crashed_prices_the_first_step_of_every_plan_never_run(world):
    w, gt = world
    start = _misranking_start(world)
    ctl = Controller(start.job, start.cluster, params=start.base_params, time_limit_s=2, build_transition=False,
                     horizon=100, total_steps=100, initial_plan=start.plan)
    assert ctl.first_run_oom_rate() == 0.0
    obs = gt.observe(ctl.plan, 0)
    ctl.step(StepMetrics(step=0, response_len_mean=obs.response_len_mean, response_len_max=obs.response_len_max,
                         stage_times={}, oom=True, oom_stage="actor/training", gpus_available=8,
                         response_len_cap=8192))
    assert ctl.first_run_oom_rate() == pytest.approx(1 / 2)  # 1 crash in 1 first step (+ 1)
    rec = ctl.audit.records[-1]
    fresh = [c for c in rec["candidates"] if c["horizon_s"] is not None]
    assert fresh
    # the same candidates scored with the crash-free record: each never-run plan's horizon is lower by
    # the rate x (its first step + a relaunch)
    from nereus.planner.online.library import Candidate
    c = Candidate(next(p for p, _ in ctl._library.values() if p.key() != ctl.plan.key() and
                       p.key() not in ctl.memory.runs and p.key() not in ctl.memory.struck), "test")
    ctl._score(c, ctl._ws, ctl._offsets_now)
    with_risk = c.horizon_s
    ctl._first_runs = [1, 0]
    ctl._score(c, ctl._ws, ctl._offsets_now)
    assert math.isfinite(with_risk) and with_risk > c.horizon_s
    assert with_risk - c.horizon_s == pytest.approx(0.5 * (c.times[0] + ctl.crash_restart_s(c.plan)))


def test_a_probes_crash_risk_is_priced_once_and_its_spread_on_the_predicted_step(world, monkeypatch):
    """The never-run plan's horizon carries its first-run crash risk (``_score``); the probe weighs
    the expected gain of the horizon without it and subtracts it once."""
    import nereus.planner.online.admission as adm

    w, gt = world
    start = _misranking_start(world)
    ctl = Controller(start.job, start.cluster, params=start.base_params, time_limit_s=2, build_transition=False,
                     horizon=100, total_steps=100, initial_plan=start.plan)
    ctl._first_runs = [1, 1]  # as if a first step had crashed: rate 1/2
    seen, real = {}, adm.expected_gain
    monkeypatch.setattr(adm, "expected_gain", lambda d, sd: seen.setdefault((d, sd), real(d, sd)))
    probe = ctl._probe

    def spy(m, cur, cands):
        out = probe(m, cur, cands)
        if out is not None:
            seen["picked"], seen["cur"] = out, cur
        return out

    monkeypatch.setattr(ctl, "_probe", spy)
    for step in range(6):
        obs = gt.observe(ctl.plan, step)
        ctl.step(StepMetrics(step=step, response_len_mean=obs.response_len_mean, response_len_max=obs.response_len_max,
                             stage_times=dict(obs.stage_s), peak_mem_gib=obs.peak_mem_gib, gpus_available=8,
                             response_len_cap=8192))
        if "picked" in seen:
            break
    c, why = seen["picked"]
    assert c.first_run_s > 0
    base = c.horizon_s - c.first_run_s
    gains = [g for k, g in seen.items() if isinstance(k, tuple) and k[0] == pytest.approx(seen["cur"].horizon_s - base)]
    assert gains, "the expected gain was not taken on the horizon without the crash risk"
    assert f"less {c.first_run_s:.1f}s of first-run crash risk" in why, why
    assert f"expected to save {gains[0] - c.first_run_s:.1f}s" in why, why


def test_a_rollback_or_any_switch_closes_a_probes_way_back(world):
    ctl, tp0, out = _run(world, slow=1.0, steps=2)  # the probe is the decision of step 1
    assert _probe_steps(out) == [1] and ctl._probe_from is not None
    ctl.report_rollback("transition failed", step=1)
    assert ctl._probe_from is None and ctl._on_key == 0


def test_a_knob_only_switch_restarts_the_steps_counted_on_a_plan(world):
    from dataclasses import replace as dc_replace

    from nereus.planner.online.library import Candidate

    w, gt = world
    start = _misranking_start(world)
    ctl = Controller(start.job, start.cluster, params=start.base_params, time_limit_s=2, build_transition=False,
                     horizon=100, total_steps=100, initial_plan=start.plan, explore=False)
    for step in range(3):
        obs = gt.observe(ctl.plan, step)
        ctl.step(StepMetrics(step=step, response_len_mean=obs.response_len_mean, response_len_max=obs.response_len_max,
                             stage_times=dict(obs.stage_s), gpus_available=8, response_len_cap=8192))
    assert ctl._on_key == ctl._on_plan == 3
    s = ctl.plan.stages[-1]
    knob = dc_replace(ctl.plan, stages=ctl.plan.stages[:-1] + (
        dc_replace(s, config=dc_replace(s.config, micro_batch=2 * s.config.micro_batch)),))
    assert knob.layout_key() == ctl.plan.layout_key() and knob.key() != ctl.plan.key()
    m = StepMetrics(step=3, response_len_mean=w.response_len_mean, response_len_max=w.response_len_max)
    ctl._switch(m, Candidate(ctl.plan, "current"), Candidate(knob, "test"), "", "test")
    assert ctl._on_key == 0 and ctl._on_plan == 3  # the layout's steps go on; the plan's start over
