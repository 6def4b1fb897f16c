"""Gradients freed after every optimizer step (``CostParams.grad_resident_frac`` = 0: Nereus's
executor sets ``param.grad = None``, as ``zero_grad(set_to_none=True)`` does) are counted only while
training runs: generation and inference no longer carry them, training's peak is unchanged. The
default (1) keeps Megatron's persistent gradient buffer, resident all step."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.errors import SpecError
from nereus.planner.cost.memory import GiB
from nereus.planner.cost.model import estimate
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import evaluate_times
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

JOB, CLUSTER = "examples/ppo-8b.yaml", "examples/cluster-h100-4n.yaml"


def test_freed_gradients_leave_the_resident_state_for_the_training_transient():
    job, cluster = load_job(JOB), load_cluster(CLUSTER)
    cfg = ParallelConfig(tp=2, dp=16, zero=1)
    base = CostParams(mem_reserve_frac=0.0)  # the held-out reserve scales both halves: left out here
    kept = estimate(job, cluster, "actor/training", cfg, params=base)
    freed = estimate(job, cluster, "actor/training", cfg, params=replace(base, grad_resident_frac=0.0))
    grads = kept.mem_breakdown["grads"]
    assert grads > 1 * GiB
    assert freed.resident_bytes == pytest.approx(kept.resident_bytes - grads)
    assert freed.transient_bytes == pytest.approx(kept.transient_bytes + grads)
    assert freed.mem_bytes == pytest.approx(kept.mem_bytes)  # training itself still holds them
    half = estimate(job, cluster, "actor/training", cfg, params=replace(base, grad_resident_frac=0.5))
    assert half.resident_bytes == pytest.approx(kept.resident_bytes - grads / 2)


def _colocated_plan(job, gpus: int) -> Plan:
    cfg = ParallelConfig(tp=2, dp=gpus // 2, zero=1)
    stages = tuple(StagePlacement(name=ms, config=cfg, pool=0, first_gpu=0, gpus=gpus, time_s=1.0)
                   for ms in job.model_stages())
    return Plan(stages=stages, step_time_s=1.0)


def test_only_the_training_stage_carries_freed_gradients_in_a_plan():
    job, cluster = load_job(JOB), load_cluster(CLUSTER)
    plan = _colocated_plan(job, cluster.num_gpus)
    w = job.workload()
    base = replace(CostParams(), mem_reserve_frac=0.0)
    kept = evaluate_times(job, cluster, plan, w, base)
    freed = evaluate_times(job, cluster, plan, w, replace(base, grad_resident_frac=0.0))
    grads = estimate(job, cluster, "actor/training", plan.stage("actor/training").config, w, base).mem_breakdown["grads"]
    critic = estimate(job, cluster, "critic/training", plan.stage("critic/training").config, w, base).mem_breakdown["grads"]
    assert freed.peak_mem_gib["actor/training"] == pytest.approx(kept.peak_mem_gib["actor/training"] - critic / GiB)
    assert freed.peak_mem_gib["critic/training"] == pytest.approx(kept.peak_mem_gib["critic/training"] - grads / GiB)
    for ms in ("actor/inference", "ref/inference", "critic/inference"):
        assert freed.peak_mem_gib[ms] == pytest.approx(kept.peak_mem_gib[ms] - (grads + critic) / GiB), ms


def test_grad_resident_frac_is_a_share():
    with pytest.raises(SpecError, match="grad_resident_frac must be in \\[0, 1\\], got 1.5"):
        CostParams(grad_resident_frac=1.5)
    assert CostParams.from_dict(CostParams(grad_resident_frac=0.0).to_dict()).grad_resident_frac == 0.0


def test_the_gpu_presets_keep_a_persistent_gradient_buffer():
    assert CostParams().grad_resident_frac == 1.0  # Megatron's contiguous grad buffer: resident all step
