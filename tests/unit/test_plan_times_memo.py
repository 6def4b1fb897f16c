"""evaluate_times with a shared memo (the controller's) gives exactly what fresh evaluations give,
for plans that share some stages and differ in others (generation TP, knobs, KV room)."""
from dataclasses import replace
from pathlib import Path

import pytest

from nereus.planner.cost.model import decode_iteration_s, decode_step_s
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import evaluate_times
from nereus.planner.online.controller import gen_tp_variants
from nereus.planner.online.plan_cache import FREE, PlanCache
from nereus.planner.specs import load_cluster, load_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup():
    job = load_job(ROOT / "examples/ppo-8b.yaml")
    cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(16)
    cache = PlanCache(job, cluster, time_limit_s=2.0, seed=0)
    plan = cache.best(FREE, job.workload(), cluster.num_gpus, CostParams())
    assert plan is not None
    plans = [plan, *gen_tp_variants(plan, job.model("actor"), cluster.gpus_per_node)]
    # a knob changed on one training stage: the other stages' estimates are shared, this one is not
    train = plan.stage("actor/training")
    other = replace(train.config, micro_batch=train.config.micro_batch * 2)
    plans.append(replace(plan, stages=tuple(replace(s, config=other) if s.name == train.name else s
                                            for s in plan.stages)))
    return job, cluster, plans, cache


def test_memo_is_exact(setup):
    job, cluster, plans, cache = setup
    assert len(plans) >= 3
    p = CostParams()
    memo: dict = {}
    loads = [job.workload().with_lengths(mean=m, max_=c) for m, c in ((800, 4096), (3000, 8192), (9000, 16384))]
    # reserve-shrunk clusters change the KV room generation gets: the memo must not share across them
    # and a cluster with slower links: the same configs cost more there
    slow = replace(cluster, gpu=replace(cluster.gpu, intra_node_gbps=cluster.gpu.intra_node_gbps / 8,
                                        inter_node_gbps=cluster.gpu.inter_node_gbps / 8))
    clusters = [cluster, cache.cluster_for(cluster.num_gpus, 8.0), slow]
    assert clusters[1].gpu.usable_bytes < cluster.gpu.usable_bytes
    for cl in clusters:
        for w in loads:
            for plan in plans + plans[::-1]:
                shared = evaluate_times(job, cl, plan, w, p, memo)
                fresh = evaluate_times(job, cl, plan, w, p)
                assert shared == fresh
    assert memo  # it was used


def test_memo_separates_kv_budgets(setup):
    """Two plans whose generation differs only in the KV room left by the other stages' residents
    must not share a generation estimate when the room changes how many sequences run at once."""
    job, cluster, plans, _ = setup
    p = CostParams()
    w = job.workload().with_lengths(mean=12000, max_=32768)
    memo: dict = {}
    base = plans[0]
    train = base.stage("actor/training")
    heavier = replace(base, stages=tuple(replace(s, config=replace(s.config, zero=0)) if s.name == train.name else s
                                         for s in base.stages))
    a = evaluate_times(job, cluster, base, w, p, memo)
    b = evaluate_times(job, cluster, heavier, w, p, memo)
    assert a == evaluate_times(job, cluster, base, w, p)
    assert b == evaluate_times(job, cluster, heavier, w, p)


def test_decode_iteration_matches_terms():
    """decode_iteration_s = max(memory, compute) + collectives + overhead, from decode_step_s."""
    job = load_job(ROOT / "examples/ppo-8b.yaml")
    cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml")
    m, p = job.model("actor"), CostParams()
    for tp in (1, 2, 4, 8):
        mem, cmp_, comm = decode_step_s(m, tp, 1, 64, 2048, cluster, p)
        assert (comm == 0.0) == (tp == 1)
        assert decode_iteration_s(m, tp, 1, 64, 2048, cluster, p) == pytest.approx(
            max(mem, cmp_) + comm + p.iteration_overhead_s("vllm", 64))


def test_decode_phase_cache_keys_everything_it_depends_on():
    """Generation estimates with the decode-integral cache warm equal fresh ones, over workloads and
    KV budgets that differ in one thing at a time (p90, cap, mean, concurrency, TP, engine, eager)."""
    from nereus.planner.cost import generation as G
    from nereus.planner.cost import model as M
    from nereus.planner.specs import ParallelConfig, RolloutSpec

    job = load_job(ROOT / "examples/ppo-8b.yaml")
    cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml")
    p = CostParams()
    base = job.workload()
    loads = [base.with_lengths(mean=2000, max_=8192), base.with_lengths(mean=2000, max_=16384),
             base.with_lengths(mean=3000, max_=8192), replace(base.with_lengths(mean=2000, max_=8192), response_len_p90=6000.0)]
    jobs = [job, replace(job, rollout=RolloutSpec(engine="sglang")), replace(job, rollout=RolloutSpec(enforce_eager=True)),
            replace(job, rollout=RolloutSpec(max_num_seqs=16))]
    cases = [(j, w, tp, budget) for j in jobs for w in loads for tp in (1, 2) for budget in (None, 6 * 2**30)]

    def run(clear: bool) -> list:
        out = []
        for j, w, tp, budget in cases:
            if clear:
                G._decode_phase.cache_clear()
            e = M.estimate(j, cluster, "actor/generation", ParallelConfig(tp=tp, dp=8 // tp), w, p, kv_budget_bytes=budget)
            out.append((e.time_s, tuple(sorted(e.time_breakdown.items()))))
        return out

    fresh = run(True)
    G._decode_phase.cache_clear()
    assert run(False) == fresh
    assert len(set(fresh)) > len(cases) // 2  # the cases do differ
