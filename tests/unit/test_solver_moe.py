"""Expert parallelism as a solver option (issue 30, item 3): MoE model-stages get (ep, etp) options
with Megatron's divisibility rules, dense ones none, and CP-SAT's optimum equals the independent
oracle's (``test_solver_oracle``, which enumerates the expert layouts itself) on small MoE instances."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.models.spec import ModelSpec
from nereus.planner.solver import CandidateSettings, PlanProblem, evaluate_plan, solve
from nereus.planner.solver.candidates import build_tables, expert_layouts
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec, load_cluster, load_job

from test_solver_oracle import _check


def _tiny_moe(experts: int = 8) -> ModelSpec:
    return ModelSpec(name="tiny-moe", layers=4, hidden=1024, ffn=2048, heads=8, kv_heads=4, vocab=32000,
                     experts=experts, experts_per_token=2, expert_ffn=1024, moe_layers=(0, 1, 2, 3))


def _problem(memory_gib: float, nodes: int, gpn: int, experts: int = 8) -> PlanProblem:
    m = _tiny_moe(experts)
    job = JobSpec(algorithm="grpo", models=(("actor", m), ("ref", m)),
                  batch=BatchSpec(prompts=32, samples_per_prompt=4),
                  sequence=SequenceSpec(prompt_len=256, response_len_mean=512, response_len_max=2048))
    gpu = replace(GPU_PRESETS["h100-80gb"], memory_gib=memory_gib, reserved_gib=0.5)
    return PlanProblem(job=job, cluster=ClusterSpec(gpu=gpu, nodes=nodes, gpus_per_node=gpn), workload=job.workload(),
                       candidates=CandidateSettings(micro_batches=(1, 2), recompute=(False,), sps=(1,)))


def test_expert_layouts_follow_megatron_and_vllm_rules():
    m = _tiny_moe()
    assert expert_layouts(m, 2, 4, "training") == [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2)]
    assert all((2 * 4) % (ep * etp) == 0 and m.experts % ep == 0 for ep, etp in expert_layouts(m, 2, 4, "training"))
    assert expert_layouts(m, 4, 2, "generation") == [(1, 1), (4, 1)]
    assert expert_layouts(m, 1, 8, "generation") == [(1, 1)]
    dense = ModelSpec(name="d", layers=4, hidden=1024, ffn=4096, heads=8, kv_heads=4, vocab=32000)
    assert expert_layouts(dense, 2, 4, "training") == [(1, 1)] == expert_layouts(dense, 2, 4, "generation")


def test_dense_option_tables_have_no_expert_options():
    job = load_job("examples/ppo-8b.yaml")
    t = build_tables(PlanProblem(job=job, cluster=load_cluster("examples/cluster-h100-1n.yaml"), workload=job.workload()))
    assert all((o.config.ep, o.config.etp) == (1, 1) for opts in t.options for o in opts)


def test_moe_tables_offer_expert_parallelism_and_never_with_zero3():
    t = build_tables(_problem(6, 1, 8))
    cfgs = [o.config for opts in t.options for o in opts]
    assert any(c.ep > 1 for c in cfgs)
    assert all(not (c.zero >= 3 and c.ep * c.etp > 1) for c in cfgs)
    assert all((c.tp * c.dp) % (c.ep * c.etp) == 0 for c in cfgs)


@pytest.mark.parametrize("memory_gib,nodes,gpn", [(3, 1, 8), (4, 1, 8), (3, 2, 4)])
def test_cpsat_objective_equals_independent_oracle_on_small_moe_instances(memory_gib, nodes, gpn):
    """Memory binds, so the expert layout decides what fits: CP-SAT's objective equals the oracle's
    exhaustive optimum over the same (ep, etp) space, and both plans pass evaluate_plan."""
    problem = _problem(memory_gib, nodes, gpn)
    sol, orc = _check(problem, zeros=problem.candidates.zeros)
    assert sol.plan is not None


def test_qwen3_30b_a3b_plan_accounts_for_every_expert():
    """The solver's plan on 4 x 8 H100: every GPU's memory includes the experts it holds."""
    job = load_job("examples/grpo-qwen3-30b-a3b.yaml")
    problem = PlanProblem(job=job, cluster=load_cluster("examples/cluster-h100-4n.yaml"), workload=job.workload())
    sol = solve(problem, backend="cpsat", workers=1, seed=0)
    assert sol.status == "OPTIMAL"
    ev = evaluate_plan(problem, sol.plan)
    assert ev.feasible and ev.peak_mem_gib > 40  # 6.2 GiB of weights at TP1 when experts were dropped
    tr = sol.plan.stage("actor/training").config
    assert tr.ep * tr.etp > 1  # 30.5B parameters cannot be replicated on every rank
