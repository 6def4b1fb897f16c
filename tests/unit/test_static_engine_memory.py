"""The memory of a static-batch engine (Hugging Face ``generate``, Nereus's reference executor, the
demo's engine), as the executor holds it:

- the batch takes all its rows at once and allocates their KV whatever room is left: short of room it
  runs out of memory; it is not a paged engine that runs fewer sequences at a time. Before, the
  planner let it run in waves: in an ad-hoc demo run (budget 1.38 x the state, caps up to 256, not
  the shipped scenario) the controller chose actor training on TP 2 with generation on TP 1 for cap
  256 and the step ran out of memory (1.13 of the budget measured);
- generation in the training layout reads the training shards (``demo.worker._generation_engine``):
  no copy of the weights. Before, the planner counted one, 3.3 MiB per process on the demo's TP-1
  plan, and the KV budget it left was sized for bf16 weights whatever the model's dtype."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.demo.setup import DemoConfig, demo_cluster, demo_job, demo_params
from nereus.planner.cost.memory import GiB, params_per_gpu
from nereus.planner.cost.model import estimate
from nereus.planner.cost.plan_times import evaluate_times, shares_training_weights
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig, RolloutSpec

CFG = DemoConfig()


def _plan(job, gen_tp: int, train_tp: int) -> Plan:
    def at(name, tp):
        return StagePlacement(name=name, config=ParallelConfig(tp=tp, dp=4 // tp, zero=1), pool=0, first_gpu=0,
                              gpus=4, time_s=1.0)
    return Plan(stages=(at("actor/generation", gen_tp), at("actor/inference", train_tp), at("ref/inference", 1),
                        at("actor/training", train_tp)), step_time_s=1.0)


def _params():
    return replace(demo_params(3.4 * 1024, 8.8 * 1024), mem_reserve_frac=0.0)


def test_a_static_batch_short_of_kv_room_runs_out_of_memory_instead_of_in_waves():
    job = replace(demo_job(CFG), sequence=replace(demo_job(CFG).sequence, response_len_max=256))
    cluster, p = demo_cluster(CFG), _params()
    w = job.workload()
    cfg = ParallelConfig(tp=1, dp=4)
    kvg = 4 * 2 * 128 * 4  # layers x (K, V) x kv width x fp32 bytes per token
    need = 8 * (4 + 256) * kvg  # 8 rows per replica, prompt + cap each
    short = estimate(job, cluster, "actor/generation", cfg, w, p, kv_budget_bytes=need * 0.6)
    assert short.time_s == float("inf") and "static batch of 8" in short.notes[0]
    assert short.mem_breakdown["kv_cache"] == pytest.approx(need)
    room = estimate(job, cluster, "actor/generation", cfg, w, p, kv_budget_bytes=need * 1.01)
    assert room.time_s < float("inf") and room.waves == 1


def test_generation_in_the_training_layout_holds_no_copy_of_the_weights():
    job, cluster, p = demo_job(CFG), demo_cluster(CFG), _params()
    w = job.workload()
    weights = 4 * params_per_gpu(job.model("actor"), 1, 1) / GiB  # fp32, TP 1
    same, apart = _plan(job, 1, 1), _plan(job, 1, 2)
    assert shares_training_weights(job, same) and not shares_training_weights(job, apart)
    paged = replace(job, rollout=RolloutSpec(engine="vllm", sleep=False))
    assert not shares_training_weights(paged, same)
    t = evaluate_times(job, cluster, same, w, p)
    e = estimate(job, cluster, "actor/generation", same.stage("actor/generation").config, w, p)
    resident = sum(estimate(job, cluster, ms, same.stage(ms).config, w, p).resident_bytes
                   for ms in ("actor/training", "ref/inference")) / GiB
    assert t.peak_mem_gib["actor/generation"] == pytest.approx(resident + e.transient_bytes / GiB - weights)
    # the copy is there when generation runs in another layout (the weight sync's target)
    t2 = evaluate_times(job, cluster, apart, w, p)
    e2 = estimate(job, cluster, "actor/generation", apart.stage("actor/generation").config, w, p)
    resident2 = sum(estimate(job, cluster, ms, apart.stage(ms).config, w, p).resident_bytes
                    for ms in ("actor/training", "ref/inference")) / GiB
    assert t2.peak_mem_gib["actor/generation"] == pytest.approx(resident2 + e2.transient_bytes / GiB)
    assert e2.mem_breakdown["weights"] / GiB == pytest.approx(weights)
