"""Baselines against the SIMULATED ground truth: the user who copies the framework's example
(static-naive) crashes and restarts when the job stops fitting; hindsight (the best single layout,
chosen knowing the trace) is never beaten by static; the oracle is never beaten by hindsight."""
import math

import pytest

from nereus.models.spec import preset
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec
from nereus.simulator.policies import naive_fix, naive_plan
from nereus.simulator.simulate import simulate
from nereus.simulator.trace import parse_trace

JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=2048, response_len_max=8192))
GROWING = "step,response_len_mean,response_len_max,gpus\n0,1000,16384,8\n6,4000,16384,8\n12,9000,16384,8\n17,9000,16384,8\n"


def test_static_naive_crashes_restarts_and_halves_the_micro_batch_when_it_stops_fitting():
    h100 = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=1)
    r = simulate(JOB, h100, parse_trace(GROWING), ["static-naive"], seed=0)["static-naive"]
    d = r.to_dict()
    first_crash = next(i for i, o in enumerate(r.ooms) if o)
    assert first_crash > 0  # the example's settings fit the short start ...
    assert d["ooms"] >= 1 and d["restarts"] >= d["ooms"] and d["restart_s"] > 0  # ... then crash and restart
    crashed_plan = r.plans[r.plan_index[first_crash - 1]]
    fixed_plan = r.plans[r.plan_index[first_crash]] if not r.dropped[first_crash] else None
    assert fixed_plan is not None and math.isfinite(r.step_s[first_crash])  # the retried step completed
    before = {s.name: s.config for s in crashed_plan.stages}
    after = {s.name: s.config for s in fixed_plan.stages}
    assert any(after[n].micro_batch < before[n].micro_batch or after[n].tp > before[n].tp for n in before)
    assert d["mean_step_s"] > (d["total_s"] - d["restart_s"]) / d["completed_steps"]  # restarts are charged


def test_naive_fix_halves_the_micro_batch_then_doubles_tp():
    plan = naive_plan(JOB, 8)
    assert plan.stage("actor/generation").config.tp == 2 and plan.stage("actor/training").config.zero == 3
    fixed = naive_fix(JOB, plan, "actor/training")
    assert fixed.stage("actor/training").config.micro_batch == plan.stage("actor/training").config.micro_batch // 2
    one = plan
    while one.stage("actor/training").config.micro_batch > 1:
        one = naive_fix(JOB, one, "actor/training")
    doubled = naive_fix(JOB, one, "actor/training")
    assert doubled.stage("actor/training").config.tp == 2 and doubled.stage("actor/inference").config.tp == 2


@pytest.fixture(scope="module")
def offline():
    h200 = ClusterSpec(gpu=GPU_PRESETS["h200"], nodes=1)
    trace = parse_trace("step,response_len_mean,response_len_max,gpus\n0,1500,8192,8\n8,3000,8192,8\n15,3000,8192,8\n")
    return simulate(JOB, h200, trace, ["static", "hindsight", "oracle"], time_limit_s=2, seed=0)


def test_hindsight_is_never_beaten_by_static_and_the_oracle_never_by_hindsight(offline):
    s, h, o = offline["static"], offline["hindsight"], offline["oracle"]
    assert not any(s.dropped) and not any(h.dropped) and not any(o.dropped)
    assert h.total_s <= s.total_s * (1 + 1e-9), (h.to_dict(), s.to_dict())
    assert o.total_s <= h.total_s * (1 + 1e-9)
    assert len({(st.name, st.config.tp, st.config.pp) for p in h.plans for st in p.stages}) == len(JOB.model_stages())
