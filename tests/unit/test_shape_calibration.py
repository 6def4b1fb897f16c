"""Calibration that learns shape: per-config factors plus a feature model of the model's error, and
probes, so the controller's ranking of generation TPs converges to the ground truth's even when the
planner's model ranks them wrongly (SIMULATED ground truth, ``nereus.simulator.truth``)."""
import math

import numpy as np
import pytest

from nereus.models.spec import preset
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import evaluate_times
from nereus.planner.online.calibration import OnlineCalibration, ShapeModel
from nereus.planner.online.controller import Controller, StepMetrics, gen_tp_variants
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec
from nereus.simulator.schedules import TransitionSchedules
from nereus.simulator.trace import constant_trace
from nereus.simulator.truth.machine import GroundTruth

JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=2048, response_len_max=8192))
CLUSTER = ClusterSpec(gpu=GPU_PRESETS["h200"], nodes=1)
# planner models to start from, each wrong about what TP costs: all-reduce latency overrated
PARAMS = (CostParams(allreduce_latency_s=20e-6), CostParams(allreduce_latency_s=10e-6))
MARGIN = 0.05
"""The planner's model must rank its choice ahead of the truth's best by at least this much."""


def _gen_tp(plan) -> int:
    return plan.stage("actor/generation").config.tp


@pytest.fixture(scope="module")
def world():
    w = JOB.workload()
    gt = GroundTruth(JOB, CLUSTER, constant_trace(w, 8, 64), seed=0, schedule_fn=TransitionSchedules(JOB, CLUSTER))
    return w, gt


def _truth_best(gt, plan) -> int:
    """The generation TP with the lowest ground-truth step time, the rest of ``plan`` kept."""
    times = {_gen_tp(q): float(np.mean(gt.step_times(q, np.arange(16))))
             for q in [plan] + gen_tp_variants(plan, JOB.model("actor"), 8)}
    return min(times, key=times.get)


def _model_times(ctl, w) -> dict[int, float]:
    return {_gen_tp(q): evaluate_times(JOB, CLUSTER, q, w, ctl.base_params).step_s
            for q in [ctl.plan] + gen_tp_variants(ctl.plan, JOB.model("actor"), 8)}


def _misranking_start(world):
    """A planner model whose initial plan's generation TP is not the ground truth's best, and
    which rates the truth's best at least MARGIN slower (a real mis-ranking, not a near-tie)."""
    w, gt = world
    for params in PARAMS:
        ctl = Controller(JOB, CLUSTER, params=params, time_limit_s=2, build_transition=False, horizon=100,
                         total_steps=100)
        best, pred = _truth_best(gt, ctl.plan), _model_times(ctl, w)
        if best != _gen_tp(ctl.plan) and pred[best] > (1 + MARGIN) * pred[_gen_tp(ctl.plan)]:
            return ctl
    pytest.fail("no planner model in PARAMS mis-ranks the generation TP against the ground truth")


def test_controller_picks_the_ground_truths_best_generation_tp_within_30_steps(world):
    w, gt = world
    ctl = _misranking_start(world)
    start = ctl.plan
    model_best = _gen_tp(start)
    # the planner's model really ranks the start's TP first (it solved for it) ...
    pred = _model_times(ctl, w)
    assert min(pred, key=pred.get) == model_best, pred
    best = _truth_best(gt, start)
    assert best != model_best  # ... and the ground truth disagrees
    prev = ctl.plan
    for step in range(30):
        obs = gt.observe(ctl.plan, step)
        assert obs.feasible, obs.violations
        d = ctl.step(StepMetrics(step=step, response_len_mean=obs.response_len_mean,
                                 response_len_max=obs.response_len_max, stage_times=dict(obs.stage_s),
                                 peak_mem_gib=obs.peak_mem_gib, gpus_available=8, response_len_cap=8192))
        if d.action == "switch":
            t = gt.transition_s(prev, d.plan)
            if t > 0:
                ctl.report_transition(t)
        prev = ctl.plan
    assert _gen_tp(ctl.plan) == best, [r["reason"] for r in ctl.audit.records if r["decision"] == "switch"]
    assert any(r["reason"].startswith("probe:") for r in ctl.audit.records)
    # the controller's calibrated ranking of the TPs it ran now agrees with the ground truth's
    ran = {k: v for k, v in ((_gen_tp(q), q) for q in [start] + gen_tp_variants(start, JOB.model("actor"), 8))}
    cal = {tp: ctl.predict(q, w)[0] for tp, q in ran.items()}
    assert min(cal, key=cal.get) == best, cal


def test_without_probes_the_controller_stays_on_the_model_s_choice(world):
    """The control run: the same start with exploration off keeps the mis-ranked TP (one multiplier
    per config cannot tell it that another TP it never ran is faster)."""
    w, gt = world
    start = _misranking_start(world)
    ctl = Controller(JOB, CLUSTER, params=start.base_params, time_limit_s=2, build_transition=False, horizon=100,
                     total_steps=100, explore=False, initial_plan=start.plan)
    for step in range(30):
        obs = gt.observe(ctl.plan, step)
        ctl.step(StepMetrics(step=step, response_len_mean=obs.response_len_mean, response_len_max=obs.response_len_max,
                             stage_times=dict(obs.stage_s), gpus_available=8, response_len_cap=8192))
    assert _gen_tp(ctl.plan) == _gen_tp(start.plan)


def test_shape_model_learns_a_slope_from_two_configs_and_extrapolates_to_a_third():
    cal = OnlineCalibration()
    # the model is 20% too slow at tp1 and exact at tp2: each doubling of tp makes the ratio x 1/1.2
    for _ in range(5):
        cal.update("actor/generation", 1.2, 1.0, config="tp1", features=(0.0, 0.0, 3.0, 0.0, 0.0, 0.0))
        cal.update("actor/generation", 1.0, 1.0, config="tp2", features=(1.0, 0.0, 2.0, 0.0, 0.0, 0.0))
    tp4 = (2.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    f4 = cal.factor("actor/generation", "tp4", tp4)
    assert f4 < 0.95, f4  # extrapolated along the axis, not the common bias (1.1)
    assert cal.factor("actor/generation", "tp1", (0.0, 0.0, 3.0, 0.0, 0.0, 0.0)) == pytest.approx(1.2)  # run: exact
    assert cal.sd("actor/generation", "tp1", (0, 0, 3, 0, 0, 0)) == 0.0 < cal.sd("actor/generation", "tp4", tp4)


def test_one_config_run_puts_the_bias_in_the_intercept_not_a_slope():
    m = ShapeModel()
    m.fit([(np.array([1.0, 1.0, 0.0, 3.0]), math.log(2.0), 5)])
    mean_far, sd_far = m.predict(np.array([1.0, 3.0, 0.0, 1.0]))
    assert mean_far == pytest.approx(math.log(2.0), rel=0.01)  # an unseen config inherits the common bias
    assert sd_far > 0.25  # but the controller knows it is unsure there
