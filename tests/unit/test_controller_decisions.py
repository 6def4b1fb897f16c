"""What a controller decision carries besides its action, and the rules around the admission
thresholds that ``test_controller_thresholds.py`` does not reach: the audit record a user reads,
whether the step solved, the trainer's cap, the horizon's sample points, the workload grid, the
memory evidence a plan collects, ``always`` mode's "no better plan" rule, and hysteresis on the
first step and before a forecast failure. Same scenario (``controller_env``)."""
from __future__ import annotations

import json
import math

import pytest

from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.library import Candidate as _Candidate, trapezoid as _trapezoid
from nereus.planner.online.plan_cache import tp_pp_of

from controller_env import env  # noqa: F401 - the scenario's module fixture
from test_controller_thresholds import H, _const, _ctl, _metrics, _run


def test_a_fresh_controller_solves_on_its_first_step_says_so_and_audits_forecast_and_cost(env, tmp_path):
    """``resolved`` is True exactly when the step asked the solver something new; the audit file
    named by ``audit_path`` holds one JSON record per step with the forecast (first and last point)
    and the decision's predicted transition time; the controller's own plan cache gets its seed."""
    path = tmp_path / "audit.jsonl"
    ctl = Controller(env.job, env.cluster, transition_cost_fn=_const(1.0), horizon=H, initial_gpus=8,
                     build_transition=False, time_limit_s=5, seed=7, audit_path=str(path))
    assert ctl.plans is not env.plans and ctl.plans.seed == 7
    solves = ctl.plans.solves
    d0 = ctl.step(_metrics(env, 0, ctl.plan))  # 32 GPUs granted: the solver is asked for them
    assert ctl.plans.solves > solves and d0.resolved
    d1 = ctl.step(_metrics(env, 1, ctl.plan))  # same question, answered from the cache
    assert not d1.resolved
    ctl.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1] and [r["resolved"] for r in recs] == [True, False]
    for r, d in zip(recs, (d0, d1)):
        cost = d.predicted_cost_s if math.isfinite(d.predicted_cost_s) else None  # JSON has no inf
        assert r["transition_s"] == cost and r["decision"] == d.action
        first, last = r["forecast"]
        assert first["response_len_max"] == last["response_len_max"] == env.w.response_len_max
        assert 0 < first["response_len_mean"] <= first["response_len_p90"] <= first["response_len_max"]


def test_stays_and_switches_for_speed_are_neither_forced_nor_infeasible(env):
    """A decision made for speed is not a must-switch and leaves a runnable plan (``must`` False,
    ``feasible`` True), whichever rule refused or admitted it."""
    probe = _ctl(env, _const(1.0))
    d = probe.step(_metrics(env, 0, probe.plan))
    assert d.action == "switch" and not d.must and d.feasible
    rec = probe.audit.records[-1]  # a candidate that does not fit the horizon is audited with horizon_s None
    frac = (rec["current_horizon_s"] - min(c["horizon_s"] for c in rec["candidates"] if c["horizon_s"] is not None)) \
        / rec["current_horizon_s"]
    ctl = _ctl(env, _const(1.0), min_gain=1.01 * frac)
    d = ctl.step(_metrics(env, 0, ctl.plan))
    assert d.action == "stay" and "within model error" in d.reason, d.reason
    assert not d.must and d.feasible
    ctl = _ctl(env, _const(1e9))
    d = ctl.step(_metrics(env, 0, ctl.plan))
    assert d.action == "stay" and "does not repay" in d.reason and not d.must and d.feasible


def test_the_horizon_is_sampled_at_its_quarters(env):
    ctl = _ctl(env, _const(1.0))
    assert ctl._offsets(0) == (1, H // 4, H // 2, 3 * H // 4, H)
    ctl = _ctl(env, _const(1.0), total_steps=100)
    assert ctl._offsets(90) == (1, 2, 4, 6, 9)  # 9 steps left after step 90
    assert ctl._offsets(99) == (1,)


def test_forecast_lengths_sit_on_the_log_grid_to_a_tenth_of_a_token(env):
    ctl = _ctl(env, _const(1.0))
    r = ctl.bucket_ratio
    for x in (137.0, 1234.0, 5000.0, 17777.0):
        b = ctl._bucket(x)
        k = round(math.log(x) / math.log(r))
        assert abs(b - r ** k) <= 0.05 + 1e-9, (x, b, r ** k)
        assert r ** -0.5 <= b / x <= r ** 0.5


def test_the_trainers_cap_is_the_forecasts_cap_and_an_observed_longer_response_raises_it(env):
    ctl = _ctl(env, _const(1e9))
    m = _metrics(env, 0, ctl.plan)
    said = int(env.w.response_len_max) + 4096
    ctl.step(StepMetrics(step=0, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                         response_len_cap=said, stage_times=m.stage_times, gpus_available=32))
    assert all(f["response_len_max"] == said for f in ctl.audit.records[-1]["forecast"])
    longer = said + 1000  # longer than any cap said: the cap was raised without a word
    ctl.step(StepMetrics(step=1, response_len_mean=m.response_len_mean, response_len_max=longer,
                         stage_times=m.stage_times, gpus_available=32))
    assert all(f["response_len_max"] == longer for f in ctl.audit.records[-1]["forecast"])


def test_a_plan_is_proven_at_the_longest_mean_it_ran_at_under_the_same_cap(env):
    """Memory evidence: a plan that ran at mean lengths 3,000 then 2,000 (same cap) is proven up to
    3,000 (+5%), not only up to the last mean it ran at."""
    ctl = _ctl(env, _const(1e9), initial_gpus=32)
    m = _metrics(env, 0, ctl.plan)
    for step, mean in ((0, 3000.0), (1, 2000.0)):
        ctl.step(StepMetrics(step=step, response_len_mean=mean, response_len_max=m.response_len_max,
                             stage_times=m.stage_times, gpus_available=32))
    plan = ctl.plan
    w = env.w.with_lengths(mean=3100.0, max_=env.w.response_len_max)
    assert ctl._proven(plan, w)
    assert not ctl._proven(plan, env.w.with_lengths(mean=3200.0, max_=env.w.response_len_max))


def test_always_mode_stays_when_no_candidate_is_faster_next_step(env):
    """``always`` switches to the plan fastest next step; when the only alternative is slower, it stays."""
    best = env.plans.best(_ctl(env, _const(1.0)).rule, env.w, 32, _ctl(env, _const(1.0)).base_params)
    _, ds = _run(env, 1, second=10.0)
    stretched = ds[0].plan  # the initial layout stretched to 32 GPUs: slower than the optimum
    assert tp_pp_of(stretched) != tp_pp_of(best)
    ctl = _ctl(env, _const(1.0), mode="always", initial_gpus=32, initial_plan=best)
    ctl._add(stretched, "test")
    assert ctl.predict(stretched, env.w)[0] > ctl.predict(best, env.w)[0]
    d = ctl.step(_metrics(env, 0, ctl.plan))
    assert d.action == "stay" and "current plan is the best" in d.reason, d.reason
    ctl = _ctl(env, _const(1.0), mode="always", initial_gpus=32, initial_plan=stretched)
    d = ctl.step(_metrics(env, 0, ctl.plan))
    assert d.action == "switch" and ctl.predict(d.plan, env.w)[0] < ctl.predict(stretched, env.w)[0]


def test_hysteresis_applies_on_the_first_step_when_the_gpu_count_did_not_change(env):
    """Starting on 32 GPUs with 32 granted is no regime change: a costly switch for speed waits for
    ``patience`` steps of the same winner, from the first step on."""
    _, ds = _run(env, 1, second=10.0)
    stretched = ds[0].plan
    ctl = _ctl(env, _const(10.0), initial_gpus=32, initial_plan=stretched, patience=2, min_dwell=0)
    d0 = ctl.step(_metrics(env, 0, ctl.plan))
    assert d0.action == "stay" and "worth it 1/2 steps in a row" in d0.reason, d0.reason
    d1 = ctl.step(_metrics(env, 1, ctl.plan))
    assert d1.action == "switch", d1.reason


def test_leaving_a_plan_predicted_to_fail_later_waits_for_patience_and_a_free_move_is_not_forced(env):
    """The alternative to a plan predicted to run out of memory later repays itself, but the switch
    costs time and there was no regime change: hysteresis holds it for ``patience`` steps. A free
    move (cost 0) is taken at once, as a switch for speed (not a must-switch)."""
    ctl = _ctl(env, _const(1.0), patience=2, min_dwell=0)
    offsets = ctl._offsets(0)
    cur_times = (10.0, 10.0) + (math.inf,) * (len(offsets) - 2)
    fast = (5.0,) * len(offsets)
    cur = _Candidate(ctl.plan, "current", horizon_s=math.inf, feasible_next=True, times=cur_times)
    alt_plan = env.plans.best(ctl.rule, env.w, 8, ctl.base_params)
    alt = _Candidate(alt_plan, "best-horizon", cost_s=1e-3, horizon_s=_trapezoid(fast, offsets), feasible_next=True,
                     times=fast)
    m = _metrics(env, 0, ctl.plan, gpus=8)
    d = ctl._admit(m, cur, [alt], "", False)
    assert d.action == "stay" and "worth it 1/2 steps in a row" in d.reason, d.reason
    d = ctl._admit(_metrics(env, 1, ctl.plan, gpus=8), cur, [alt], "", False)
    assert d.action == "switch" and not d.must, d.reason
    ctl = _ctl(env, _const(1.0), patience=2, min_dwell=0)
    free = _Candidate(ctl.plan, "keep-layout", cost_s=0.0, horizon_s=_trapezoid(fast, offsets), feasible_next=True,
                      times=fast)
    d = ctl._admit(m, _Candidate(ctl.plan, "current", horizon_s=math.inf, feasible_next=True, times=cur_times),
                   [free], "", False)
    assert d.action == "switch" and not d.must and "costs no transition" in d.reason, d.reason


def test_a_stay_because_every_alternative_is_slower_says_so_and_names_the_gap(tmp_path):
    """When no library plan is faster over the horizon, no transition is priced (their cost is
    unknown, inf), and the reason must say the alternatives are slower, not that none is feasible
    at a known cost: the README's loop on examples/ppo-8b.yaml, steps 0-1 at a 2k mean."""
    from pathlib import Path

    from nereus.planner.online.adapters import from_verl
    from nereus.planner.specs import load_cluster, load_job

    root = Path(__file__).resolve().parents[2]
    job, cluster = load_job(root / "examples/ppo-8b.yaml"), load_cluster(root / "examples/cluster-h100-4n.yaml")
    path = tmp_path / "audit.jsonl"
    ctl = Controller(job, cluster, horizon=200, margin=0.25, audit_path=str(path))
    for step in range(2):
        metrics = {"response_length/mean": 2048 * 1.1 ** step, "response_length/max": 8192,
                   "timing_s/gen": 0.02 * 2048 * 1.1 ** step, "timing_s/update_actor": 20.0}
        d = ctl.step(from_verl(metrics, step=step, gpus_available=32, response_len_cap=8192))
        assert d.action == "stay" and d.reason.startswith("no alternative is faster over the horizon"), d.reason
    ctl.close()
    rec = json.loads(path.read_text().splitlines()[-1])
    scored = [c["horizon_s"] for c in rec["candidates"] if c["horizon_s"] is not None]
    assert scored and min(scored) >= rec["current_horizon_s"]
    gap = float(rec["reason"].split("the best is ")[1].split("s slower")[0])
    assert gap == pytest.approx(min(scored) - rec["current_horizon_s"], abs=0.06)
