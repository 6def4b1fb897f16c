"""A frozen model's forward under ZeRO-3 / FSDP (verl's FSDP reference model) holds 1/dp of its
weights plus the layers it gathers, as its time already assumes (``fsdp_gather``): before, the
weights were counted whole, 55.5 GiB per GPU for Qwen3-30B-A3B, so verl's FSDP plan of it did not fit."""
from __future__ import annotations

import pytest

from nereus.planner.cost.memory import GiB, params_per_gpu
from nereus.planner.cost.model import estimate
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

C4 = "examples/cluster-h100-4n.yaml"


@pytest.mark.parametrize("job,ms,tp,dp", [("grpo-qwen3-30b-a3b", "ref/inference", 2, 16),
                                          ("ppo-8b", "ref/inference", 1, 8), ("ppo-8b", "actor/inference", 1, 32)])
def test_zero3_inference_weights_are_sharded_over_dp(job, ms, tp, dp):
    j, c = load_job(f"examples/{job}.yaml"), load_cluster(C4)
    model = j.model(ms.split("/")[0])
    whole = model.dtype_bytes * params_per_gpu(model, tp, 1, "lm", 1)
    z1 = estimate(j, c, ms, ParallelConfig(tp=tp, dp=dp, zero=1))
    z3 = estimate(j, c, ms, ParallelConfig(tp=tp, dp=dp, zero=3))
    assert z1.mem_breakdown["weights"] == pytest.approx(whole)  # ZeRO-1 (DP replicas): whole, as before
    assert z3.mem_breakdown["weights"] == pytest.approx(whole / dp)
    # gathered for the forward: the layer computed and the one prefetched
    assert z3.mem_breakdown["fsdp_unsharded"] == pytest.approx(whole * 2 / model.layers)
    assert "fsdp_unsharded" not in z1.mem_breakdown
    assert z3.time_breakdown["fsdp_gather"] > 0 and z3.mem_bytes < z1.mem_bytes


def test_verl_fsdp_plan_of_qwen3_30b_a3b_fits():
    """The MoE emitter's case: verl's FSDP engine has no EP, so the plan's experts are sharded by
    ZeRO-3 instead (``verl.repair``); its reference model now holds 3.5 GiB per GPU, not 55.5 GiB."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_frameworks import make_plan

    from nereus.frameworks import verl
    from nereus.planner.solver import PlanProblem, evaluate_plan

    job = load_job("examples/grpo-qwen3-30b-a3b.yaml")
    problem = PlanProblem(job=job, cluster=load_cluster(C4), workload=job.workload())
    ep_plan = {"actor/generation": (ParallelConfig(tp=4, dp=8, ep=4), 0, 32),
               "actor/training": (ParallelConfig(tp=2, dp=16, ep=8), 0, 32),
               "ref/inference": (ParallelConfig(tp=2, dp=16, ep=8, micro_batch=2), 0, 32)}
    _, plan = verl.repair("fsdp", job)(problem, make_plan(job, ep_plan))[0]
    ref = plan.stage("ref/inference").config
    assert (ref.ep, ref.zero, ref.dp) == (1, 3, 16)
    e = estimate(job, problem.cluster, "ref/inference", ref, problem.workload)
    assert e.mem_breakdown["weights"] / GiB < 4.0
    ev = evaluate_plan(problem, plan)
    assert ev.feasible, ev.violations
    assert ev.peak_mem_gib < 50

    assert job.model("ref").is_moe
