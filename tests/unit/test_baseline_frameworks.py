"""The verl-like and OpenRLHF-like baselines hold what the frameworks do (policies.py docstrings give
the sources): FSDP / DeepSpeed ZeRO-3 for every model, frozen ones sharded too, TP1 PP1 outside the
rollout; OpenRLHF both with its models apart and colocate-all. And the reproduction's ratios are
taken on the steps both policies completed."""
import math
import sys
from pathlib import Path

import pytest

from nereus.planner.cost.model import estimate
from nereus.planner.online.plan_cache import PlanCache
from nereus.planner.specs import ParallelConfig, load_cluster, load_job
from nereus.simulator.policies import make_controller, rollout_tp
from nereus.simulator.simulate import SIM_CANDIDATES, PolicyResult

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import simulate_repro  # noqa: E402

JOB32 = load_job(ROOT / "examples/ppo-32b.yaml")
NODE = load_cluster(ROOT / "examples/cluster-h100-1n.yaml")
NODES4 = load_cluster(ROOT / "examples/cluster-h100-4n.yaml")


def test_a_frozen_model_under_zero3_keeps_only_its_shard_resident():
    one = estimate(JOB32, NODE, "ref/inference", ParallelConfig(tp=1, dp=8, zero=1), JOB32.workload())
    three = estimate(JOB32, NODE, "ref/inference", ParallelConfig(tp=1, dp=8, zero=3), JOB32.workload())
    assert three.resident_bytes == pytest.approx(one.resident_bytes / 8)
    assert three.mem_breakdown["fsdp_unsharded"] > 0 == one.mem_breakdown.get("fsdp_unsharded", 0)  # gathered layers
    assert three.time_breakdown["fsdp_gather"] > 0


JOB8 = load_job(ROOT / "examples/grpo-8b.yaml")


@pytest.fixture(scope="module")
def first_plans():
    """Each baseline's step-0 plan on 4 nodes: verl-like for 32B PPO (its frozen reference and reward
    fit only sharded), the OpenRLHF-like pair for 8B GRPO (PPO's five units apart find no node-aligned pools on 32 GPUs)."""
    out = {}
    for names, job in ((("verl",), JOB32), (("openrlhf", "openrlhf-colocate"), JOB8)):
        plans = PlanCache(job, NODES4, time_limit_s=2.0, candidates=SIM_CANDIDATES, deterministic=True)
        for name in names:
            out[name] = (job, make_controller(name, job, NODES4, job.workload(), 32, total_steps=10, plans=plans).plan)
    return out


@pytest.mark.parametrize("name", ["verl", "openrlhf", "openrlhf-colocate"])
def test_framework_baselines_run_every_model_zero3_at_tp1_frozen_ones_included(first_plans, name):
    job, plan = first_plans[name]
    for s in plan.stages:
        if s.name == "actor/generation":
            assert s.config.tp == rollout_tp(job)
        else:
            assert (s.config.tp, s.config.pp, s.config.zero) == (1, 1, 3), (name, s.name, s.config)
    assert "ref/inference" in {s.name for s in plan.stages}


def test_openrlhf_colocate_all_shares_every_gpu_and_the_default_keeps_models_apart(first_plans):
    co, apart = first_plans["openrlhf-colocate"][1], first_plans["openrlhf"][1]
    assert all(s.first_gpu == 0 and s.gpus == 32 for s in co.stages)
    gen = apart.stage("actor/generation")
    train = apart.stage("actor/training")
    assert gen.first_gpu + gen.gpus <= train.first_gpu or train.first_gpu + train.gpus <= gen.first_gpu


def _result(name, step_s, dropped=()):
    n = len(step_s)
    return PolicyResult(policy=name, step_s=tuple(step_s), transition_s=(0.0,) * n,
                        dropped=tuple(i in dropped for i in range(n)))


def test_ratios_are_taken_on_the_steps_both_completed():
    nan = math.nan
    a = _result("adaptive", [10, 10, 10, 10])
    b = _result("verl", [20, nan, nan, 20], dropped={1, 2})  # verl dropped the two steps in the middle
    c = simulate_repro.on_common_steps(a, b)
    assert c["steps_both"] == 2 and c["completed"] == 4 and c["completed_ref"] == 2
    assert c["throughput_x"] == pytest.approx(2.0) and c["latency_reduction"] == pytest.approx(0.5)


def test_best_of_picks_the_faster_baseline_on_common_steps():
    res = {"static": _result("static", [10, 30, 10]), "static-naive": _result("static-naive", [12, 12, 12])}
    assert simulate_repro.best_of(res, ("static", "static-naive")) == "static-naive"  # 16.7 against 12 per step
    res["static-naive"] = _result("static-naive", [12, math.nan, 12], dropped={1})
    assert simulate_repro.best_of(res, ("static", "static-naive")) == "static"  # 10 against 12 where both ran


def test_a_sharded_reference_holds_its_shard_in_the_transition_planner_too(first_plans):
    """The EMUs of a frozen model under ZeRO-3 hold 1/dp of its params (so a transition to or from
    verl-like's plan is priced on shards, not on whole weights that do not fit a GPU)."""
    from dataclasses import replace

    from nereus.planner.transition.build import transition_cost
    from nereus.planner.transition.emu import gpu_regions, kinds_of

    _, plan = first_plans["verl"]
    ref = plan.stage("ref/inference")
    kinds = tuple(kinds_of("ref"))
    elems = lambda p: sum(math.prod(r.lengths) for r in gpu_regions(JOB32.model("ref"), "ref", p, 0, 0, 0, kinds))  # noqa: E731
    assert elems(ref) * ref.config.dp == pytest.approx(elems(replace(ref, config=replace(ref.config, zero=1))), rel=0.01)
    fewer = replace(plan, stages=tuple(replace(s, config=replace(s.config, micro_batch=1)) for s in plan.stages))
    other_tp = replace(fewer, stages=tuple(replace(s, config=replace(s.config, tp=8, dp=4)) if s.name == "actor/generation"
                                           else s for s in fewer.stages))
    assert math.isfinite(transition_cost(plan, other_tp, NODES4, JOB32))
