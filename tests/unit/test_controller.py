"""Controller behaviour against the simulated ground truth (small instances, one solver worker)."""
import math

import pytest

from nereus.planner.online.adapters import from_verl
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.forecast import LengthForecaster
from nereus.simulator.model_world import ModelWorld
from nereus.planner.specs import load_cluster, load_job

EX = "examples/"


@pytest.fixture(scope="module")
def setup():
    job = load_job(EX + "grpo-7b.yaml")
    cluster = load_cluster(EX + "cluster-h100-1n.yaml")
    return job, cluster, ModelWorld(job, cluster, seed=1)


def _metrics(step, w, obs, gpus=8, cap=None):
    return StepMetrics(step=step, response_len_mean=w.response_len_mean, response_len_max=w.response_len_max,
                       stage_times=dict(obs.stage_s), gpus_available=gpus, response_len_cap=cap, oom=not obs.feasible)


def test_calibration_converges_below_5_percent_within_20_steps(setup):
    job, cluster, gt = setup
    ctl = Controller(job, cluster, transition_cost_fn=lambda a, b: 1e9, time_limit_s=2)
    w = job.workload()
    truth = gt.times(ctl.plan, w).step_s
    before = abs(ctl.predict(ctl.plan, w)[0] - truth) / truth
    for step in range(20):
        d = ctl.step(_metrics(step, w, gt.observe(ctl.plan, w, step)))
        assert d.action == "stay"
    after = abs(ctl.predict(ctl.plan, w)[0] - truth) / truth
    assert before > 0.10, before  # the ground truth really is biased
    assert after < 0.05, after


@pytest.mark.parametrize("cost_s,expect_switch", [(1e7, False), (1.0, True)])
def test_never_switches_when_saving_cannot_repay(setup, cost_s, expect_switch):
    """8 -> 32 GPUs makes a much faster plan available; at an absurd transition cost the saving
    over the horizon cannot repay it, so the controller stays (and the control case switches)."""
    job, _, _ = setup
    cluster = load_cluster(EX + "cluster-h100-4n.yaml")
    gt = ModelWorld(job, cluster, seed=1)
    ctl = Controller(job, cluster, initial_gpus=8, transition_cost_fn=lambda a, b: cost_s, horizon=50, time_limit_s=2)
    w = job.workload()
    switched = []
    for step in range(6):
        d = ctl.step(_metrics(step, w, gt.observe(ctl.plan, w, step), gpus=32))
        assert not d.must
        if d.action == "switch" and d.predicted_cost_s > 0:
            switched.append(d)
    assert bool(switched) == expect_switch, [r["reason"] for r in ctl.audit.records]
    if expect_switch:  # the caller gets the transition graph to apply, built by the transition planner
        t = switched[0].transition
        assert t is not None and t.bytes_moved > 0 and t.makespan_s > 0
    else:
        assert any("does not repay" in r["reason"] for r in ctl.audit.records)


def test_no_flapping_on_noisy_flat_trace(setup):
    job, cluster, _ = setup
    gt = ModelWorld(job, cluster, seed=3, noise=0.08)
    ctl = Controller(job, cluster, time_limit_s=2)
    base = job.workload()
    switches = 0
    for step in range(40):
        w = base.with_lengths(mean=base.response_len_mean * (1 + 0.1 * math.sin(step * 2.1)))
        d = ctl.step(_metrics(step, w, gt.observe(ctl.plan, w, step)))
        switches += d.action == "switch" and d.predicted_cost_s > 0
    assert switches <= 1, [r["reason"] for r in ctl.audit.records if r["decision"] == "switch"]
    # a stay never quotes a negative saving: when every alternative is slower, the reason says so
    reasons = [r["reason"] for r in ctl.audit.records]
    assert not any("saving -" in r for r in reasons), reasons


def test_switches_before_oom_on_growing_trace(setup):
    job, cluster, gt = setup
    ctl = Controller(job, cluster, time_limit_s=2)
    first = ctl.plan
    base = job.workload()
    caps = [4096] * 5 + [16384] * 5 + [32768] * 5
    assert not gt.times(first, base.with_lengths(mean=12000, max_=32768)).feasible  # the start plan would OOM
    musts = 0
    for step in range(len(caps) - 1):
        w = base.with_lengths(mean=min(0.7 * caps[step], 1500 + 800 * step), max_=caps[step])
        obs = gt.observe(ctl.plan, w, step)
        assert obs.feasible, (step, obs.violations)
        d = ctl.step(_metrics(step, w, obs, cap=caps[step + 1]))
        musts += d.must
        nxt = base.with_lengths(mean=min(0.7 * caps[step + 1], 1500 + 800 * (step + 1)), max_=caps[step + 1])
        assert gt.times(d.plan, nxt).feasible, (step, d.reason)
    assert musts >= 1


def test_step_without_resolve_is_fast(setup):
    job, cluster, gt = setup
    ctl = Controller(job, cluster, time_limit_s=2)
    w = job.workload()
    ds = [ctl.step(_metrics(s, w, gt.observe(ctl.plan, w, s))) for s in range(15)]
    fast = sorted(d.overhead_s for d in ds if not d.resolved)
    # median, not max: the machine is shared, and a step that misses the evaluation cache pays ~1 ms per
    # plan; the bound tells cached evaluation (1-2 ms alone, ~10 ms beside a full test run) from a solve
    # (100s of ms); the speed itself is a benchmark's business
    assert len(fast) >= 10 and fast[len(fast) // 2] < 0.03, fast


def test_forecast_follows_linear_growth_and_respects_cap():
    f = LengthForecaster(window=20)
    for s in range(20):
        f.observe(s, 1000 + 20 * s + (50 if s % 7 == 0 else 0), cap=8192)
    assert abs(f.forecast(10).response_len_mean - (1000 + 20 * 29)) < 60
    assert f.forecast(10_000).response_len_mean <= 8192


def test_verl_adapter_maps_metric_names():
    m = from_verl({"response_length/mean": 1800.0, "response_length/max": 4096, "timing_s/gen": 40.0,
                   "timing_s/update_actor": 12.0, "timing_s/ref": 2.0, "perf/max_memory_allocated_gb": 60.0},
                  step=7, gpus_available=8)
    assert m.stage_times == {"actor/generation": 40.0, "actor/training": 12.0, "ref/inference": 2.0}
    assert m.response_len_max == 4096 and m.step == 7 and 55 < m.peak_mem_gib < 56


def test_audit_log_records_every_decision_with_its_numbers(setup, tmp_path):
    from nereus.planner.online.audit import read_audit

    job, cluster, gt = setup
    path = tmp_path / "audit.jsonl"
    ctl = Controller(job, cluster, audit_path=str(path), time_limit_s=2)
    w = job.workload()
    for s in range(3):
        ctl.step(_metrics(s, w, gt.observe(ctl.plan, w, s)))
    ctl.close()
    recs = read_audit(path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert {"forecast", "current_step_s", "candidates", "transition_s", "break_even_steps", "decision",
                "reason"} <= set(r)
        assert r["decision"] in ("stay", "switch") and r["current_step_s"] > 0


@pytest.fixture
def tight_transitions(monkeypatch):
    """Transition plans as the planner makes them, but reported as not fitting with the old state
    kept until commit (keep-old peak 1.5x capacity)."""
    import dataclasses

    import nereus.planner.transition.build as T

    real = T.plan_transition

    def tight(*args, **kwargs):
        tp = real(*args, **kwargs)
        st = dict(tp.stats)
        st.update(keep_old_fits=False, peak_mem_bytes_keep_old=1.5 * st["capacity_bytes"])
        return dataclasses.replace(tp, stats=tuple(st.items()))

    monkeypatch.setattr(T, "plan_transition", tight)


def test_no_speed_switch_when_the_transition_would_not_fit_with_the_old_state_kept(setup, tight_transitions):
    """A switch for speed whose old state, kept until commit for rollback, would not fit next to
    the new one is not taken: the controller stays and says why."""
    job, _, _ = setup
    cluster = load_cluster(EX + "cluster-h100-4n.yaml")
    gt = ModelWorld(job, cluster, seed=1)
    ctl = Controller(job, cluster, initial_gpus=8, transition_cost_fn=lambda a, b: 1.0, horizon=50, time_limit_s=2)
    w = job.workload()
    decisions = [ctl.step(_metrics(step, w, gt.observe(ctl.plan, w, step), gpus=32)) for step in range(6)]
    # the same run switches when the transition fits (test above); here it stays and says why
    assert all(d.action == "stay" for d in decisions), [d.reason for d in decisions]
    assert any("keeping the old state until commit" in d.reason and "no host staging" in d.reason for d in decisions)


def test_must_switch_still_happens_when_the_transition_is_tight(setup, tight_transitions):
    """Out of memory next step is certain, a tight transition is not: a must-switch goes ahead and
    carries the warning."""
    job, cluster, gt = setup
    ctl = Controller(job, cluster, time_limit_s=2)
    base = job.workload()
    caps = [4096] * 5 + [16384] * 5 + [32768] * 5
    musts = []
    for step in range(len(caps) - 1):
        w = base.with_lengths(mean=min(0.7 * caps[step], 1500 + 800 * step), max_=caps[step])
        d = ctl.step(_metrics(step, w, gt.observe(ctl.plan, w, step), cap=caps[step + 1]))
        if d.must and d.action == "switch" and d.transition is not None:
            musts.append(d)
        assert d.must or d.action == "stay" or d.transition is None, d.reason
    assert musts and all("warning: keeping the old state until commit" in d.reason for d in musts)
