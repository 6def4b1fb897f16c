"""The controller calibrates an asynchronous plan on like-for-like quantities (issue 28 / 29):
a streaming rollout's logged generation time is its batch's latency, so the generation factor is
learned against the planner's batch-latency estimate of the same config; how the rollout and
the trainer overlap is learned from the logged step time (``StepMetrics.step_s``), in steady
state, two steps at a time; and stage estimates shared between plans never cross schedules.
GRPO-8B fully-async on 128 H100s; observed times are the planner's own, scaled (this tests the
controller's bookkeeping, not the cost model)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import compose_step, evaluate_times
from nereus.planner.cost.plan_times import as_batch, overlap_kind
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import load_cluster, load_job

ROOT = Path(__file__).resolve().parents[2]
JOB = replace(load_job(ROOT / "examples/grpo-8b.yaml"), schedule=ScheduleSpec(kind="fully_async", staleness=1))
CLUSTER = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(128)
GEN = "actor/generation"
MEAN = 1000.0


@pytest.fixture(scope="module")
def start():
    w = JOB.workload().with_lengths(mean=MEAN, max_=JOB.sequence.response_len_max)
    ctl = Controller(JOB, CLUSTER, horizon=30, build_transition=False, total_steps=40, initial_workload=w)
    # lengths on the controller's bucket grid, so that what it predicts for the logged step is this
    w = w.with_lengths(mean=ctl._bucket(MEAN), max_=int(ctl._bucket(w.response_len_max)))
    return ctl.plan, w


def _ctl(start) -> Controller:
    plan, w = start
    return Controller(JOB, CLUSTER, horizon=30, build_transition=False, total_steps=40, initial_workload=w,
                      initial_plan=plan, explore=False)


def _obs(ctl: Controller, w, step: int, gen_x: float = 1.0, step_x: float | None = None) -> StepMetrics:
    """What the loop logs: the plan's generation as its batch's latency x ``gen_x``, the other
    stages as predicted; the step as the composition of those x ``step_x`` (None: not logged)."""
    batch = evaluate_times(JOB, CLUSTER, as_batch(JOB, ctl.plan), w, ctl.base_params).stage_s
    t = evaluate_times(JOB, CLUSTER, ctl.plan, w, ctl.base_params)
    stages = {**t.stage_s, GEN: batch[GEN] * gen_x}
    step_s = None if step_x is None else step_x * compose_step(JOB, ctl.plan, t.stage_s, t.weight_sync_s)
    return StepMetrics(step=step, response_len_mean=w.response_len_mean, response_len_max=w.response_len_max,
                       response_len_cap=w.response_len_max, stage_times=stages, step_s=step_s)


def test_the_streaming_estimate_and_the_batch_latency_differ_and_the_memo_keeps_them_apart(start):
    plan, w = start
    assert overlap_kind(JOB, plan) == "step/fully_async" and as_batch(JOB, as_batch(JOB, plan)).key() == as_batch(JOB, plan).key()
    alone = [evaluate_times(JOB, CLUSTER, p, w, CostParams()).stage_s[GEN] for p in (plan, as_batch(JOB, plan))]
    assert alone[1] > 1.5 * alone[0], alone  # a batch on its own waits for its longest response
    memo: dict = {}
    shared = [evaluate_times(JOB, CLUSTER, p, w, CostParams(), memo).stage_s[GEN] for p in (plan, as_batch(JOB, plan))]
    assert shared == pytest.approx(alone, rel=1e-12)


def test_the_generation_factor_is_learned_on_the_batch_latency(start):
    _, w = start
    ctl = _ctl(start)
    for step in range(4):
        ctl.step(_obs(ctl, w, step, gen_x=1.1))
    assert ctl.calibration.factor(GEN) == pytest.approx(1.1, rel=1e-6)  # not the 3x of latency / streaming share


def test_the_step_composition_is_learned_in_steady_state_two_steps_at_a_time(start):
    _, w = start
    ctl = _ctl(start)
    key, row = "step/fully_async", ctl.plan.layout_key()
    ctl.step(_obs(ctl, w, 0, step_x=10.0))  # the first step fills the pipeline: not steady state
    ctl.step(_obs(ctl, w, 1, step_x=1.2))
    assert not ctl.calibration.seen(key, row)  # one steady-state step: half a pair
    ctl.step(_obs(ctl, w, 2, step_x=1.4))
    assert ctl.calibration.factor(key, row) == pytest.approx(1.3, rel=1e-6)  # (1.2 + 1.4) / 2, the 10x left out
    t = evaluate_times(JOB, CLUSTER, ctl.plan, w, ctl.base_params)
    composed = compose_step(JOB, ctl.plan, ctl._corrected(ctl.plan, t.stage_s), t.weight_sync_s)
    assert ctl.predict(ctl.plan, w)[0] == pytest.approx(1.3 * composed, rel=1e-6)


def test_without_a_logged_step_nothing_is_learned_of_the_composition(start):
    _, w = start
    ctl = _ctl(start)
    for step in range(5):
        ctl.step(_obs(ctl, w, step))
    assert not ctl.calibration.seen("step/fully_async", ctl.plan.layout_key())
    t = evaluate_times(JOB, CLUSTER, ctl.plan, w, ctl.base_params)
    assert ctl.predict(ctl.plan, w)[0] == pytest.approx(
        compose_step(JOB, ctl.plan, ctl._corrected(ctl.plan, t.stage_s), t.weight_sync_s), rel=1e-9)


def test_a_layout_never_run_takes_the_spread_between_the_layouts_run():
    """The pooled step-composition factor's uncertainty holds the spread between the layouts
    measured, not only their measurement noise: a layout never run may be any of them."""
    from nereus.planner.online.calibration import OnlineCalibration

    cal = OnlineCalibration()
    for a, b in ((1.0, 1.02), (1.02, 1.0), (1.0, 1.02)):  # two layouts, 1.01 and 1.5 on average
        cal.update("step/fully_async", a, 1.0, "A")
        cal.update("step/fully_async", 1.5 * b, 1.0, "B")
    noise_only = 1.2533 * cal.noise("step/fully_async") / 6 ** 0.5
    assert cal.pooled_se("step/fully_async") > 10 * noise_only
    one = OnlineCalibration()
    for a in (1.0, 1.02, 1.0):
        one.update("step/fully_async", a, 1.0, "A")
    assert one.pooled_se("step/fully_async") == pytest.approx(1.2533 * one.noise("step/fully_async") / 3 ** 0.5)
