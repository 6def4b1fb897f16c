"""What the online controller hands its caller (found unchecked by mutation testing): a switch
built with its transition plan, the audit record of every decision (the README's
``audit_path``), and the reason of a switch forced by a predicted out-of-memory step. Same
scenario as test_controller_thresholds.py: GRPO-7B starting on 8 of 32 H100s."""
from __future__ import annotations

import pytest

from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.transition.types import TransitionPlan

from controller_env import env, observed  # noqa: F401 - the scenario's module fixture


def test_a_switch_built_with_its_transition_carries_the_plan_between_the_two_layouts(env):
    from nereus.planner.transition.build import plan_transition

    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e-3, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=True)  # a cost > 0: a real move, built
    before = ctl.plan
    d = ctl.step(observed(env, 0, before))
    assert d.action == "switch" and d.plan.num_gpus == 32, d.reason
    assert isinstance(d.transition, TransitionPlan) and d.transition.bytes_moved > 0
    want = plan_transition(env.job, env.cluster, before, d.plan)
    assert (d.transition.bytes_moved, d.transition.bytes_kept) == (want.bytes_moved, want.bytes_kept)
    assert {h.gpu for h in d.transition.dst} <= set(range(32)) and ctl.plan == d.plan


def test_every_decision_is_audited_with_its_reason_and_the_predicted_step_time(env):
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e9, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False)
    plan = ctl.plan
    d = ctl.step(observed(env, 0, plan, gpus=8))
    rec = ctl.audit.records[-1]
    assert rec["step"] == 0 and rec["decision"] == d.action and rec["must"] == d.must and rec["reason"] == d.reason
    assert rec["gpus"] == 8
    assert rec["current_step_s"] == pytest.approx(ctl.predict(plan, ctl._ws0)[0], rel=1e-9)
    assert rec["current_horizon_s"] > rec["current_step_s"] > 0


def test_a_cap_raise_the_current_plan_cannot_hold_forces_a_switch_that_says_why(env):
    """The trainer announces a 16x longer response cap: the 8-GPU plan is predicted out of memory
    for the next step, so the controller must move whatever the transition costs."""
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e9, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False)
    cap = 16 * env.job.sequence.response_len_max
    d = ctl.step(observed(env, 0, ctl.plan, response_len_cap=cap))
    assert d.must and d.action == "switch", d.reason
    assert d.reason.startswith("must switch: current plan predicted out of memory next step;"), d.reason


def test_the_always_re_plan_mode_takes_the_fastest_plan_for_the_next_step_then_stays(env):
    """The baseline that re-plans every step: of its candidates the one predicted fastest for the
    next step, when it beats the current plan by more than 0.5%; on that plan the next step stays."""
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e9, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False, mode="always")
    d = ctl.step(observed(env, 0, ctl.plan))
    rec = ctl.audit.records[-1]
    assert d.action == "switch" and d.reason.startswith("always: best plan for next step"), d.reason
    assert "best-next" in {c["origin"] for c in rec["candidates"]}
    fastest = min(c["step_s"] for c in rec["candidates"])
    assert ctl.predict(d.plan, ctl._ws0)[0] == pytest.approx(fastest, rel=1e-9)
    assert fastest < 0.995 * rec["current_step_s"]
    again = ctl.step(observed(env, 1, d.plan))
    assert again.action == "stay" and again.reason.startswith("always: current plan is the best"), again.reason


@pytest.mark.parametrize("step, left", [(0, 50), (90, 9), (99, 1)])
def test_the_horizon_spans_the_steps_left_and_integrates_the_predicted_step_time(env, step, left):
    """100 steps, a 50-step horizon, constant lengths: the horizon cost is the predicted step time
    times min(50, steps left after this one), at least one step."""
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e9, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False, total_steps=100)
    ctl.step(observed(env, step, ctl.plan, gpus=8))
    rec = ctl.audit.records[-1]
    assert rec["current_horizon_s"] == pytest.approx(left * rec["current_step_s"], rel=1e-9)


def test_the_observed_tail_of_the_response_lengths_enters_the_calibration(env):
    """Two controllers see the same stage times; one is told a longer p90 of the response lengths
    (clipped at the longest response). The cost model predicts generation from that tail, so the
    learned correction differs; told a p90 beyond the longest, it is the longest."""
    def calibrated(p90):
        ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e9, horizon=50, plans=env.plans,
                         initial_gpus=8, build_transition=False)
        ctl.step(observed(env, 0, ctl.plan, gpus=8, response_len_p90=p90))
        return ctl.calibration.to_dict()["model_stage"]["actor/generation"]

    mean, mx = env.w.response_len_mean, env.w.response_len_max
    short, long = calibrated(1.2 * mean), calibrated(0.9 * mx)
    assert short != pytest.approx(long, rel=1e-6), (short, long)
    assert calibrated(10 * mx) == pytest.approx(calibrated(float(mx)), rel=1e-12)


def test_a_memory_underestimate_on_a_small_device_reserves_about_the_underestimate_not_most_of_the_device():
    """The demo's 1.5 x budget (17 MiB "devices"): a 1 GiB rounding quantum, capped at 75% of the
    device, turned any underestimate into a reserve of 12.9 MiB, and no plan fitted again. The quantum
    is now 1/64 of the device where that is under 1 GiB."""
    from nereus.demo.setup import DemoConfig, demo_cluster, demo_job, demo_params

    cfg = DemoConfig(budget_k=1.5)
    job, cluster = demo_job(cfg), demo_cluster(cfg)
    ctl = Controller(job, cluster, params=demo_params(0.0, 0.0), transition_cost_fn=lambda a, b: 1.0, horizon=10,
                     build_transition=False, time_limit_s=5)
    usable = cluster.gpu.usable_bytes / 2**30
    w = job.workload()
    pred = ctl._times(ctl.plan, w)
    peak = max(v for ms, v in pred.peak_mem_gib.items() if not ms.endswith("/generation"))
    under = 0.02 * usable  # 2% of the device over the prediction
    ctl.step(StepMetrics(step=0, response_len_mean=w.response_len_mean, response_len_max=w.response_len_max,
                         stage_times={s.name: 0.1 for s in ctl.plan.stages}, peak_mem_gib=peak + under))
    q = usable / 64
    assert under <= ctl.memory.common_gib <= under + q + 1e-12, (ctl.memory.common_gib, usable)
    assert ctl.memory.common_gib < 0.1 * usable


def test_a_decision_says_why_what_it_cost_to_decide_and_whether_it_re_solved(env):
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1.0, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False)
    d = ctl.step(observed(env, 0, ctl.plan))
    assert d.action == "switch" and d.reason.startswith("saving ") and "over the horizon > 1.0s x (1 + " in d.reason
    assert 0 < d.overhead_s < 60, d.overhead_s  # seconds this decision took, not a clock reading
    rec = ctl.audit.records[-1]
    assert rec["resolved"] is d.resolved
