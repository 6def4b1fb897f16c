"""The online controller tests' scenario, in one place: GRPO-7B on a 4-node H100 cluster (32 GPUs),
observed stage times from the simulator's model world (``ModelWorld``: the cost model with other
coefficients and noise, so the controller has something to calibrate), and one plan cache per test
module (the same solver answers, solved once)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nereus.planner.online.controller import StepMetrics
from nereus.planner.online.plan_cache import PlanCache
from nereus.planner.specs import load_cluster, load_job
from nereus.simulator.model_world import ModelWorld

EX = "examples/"


@pytest.fixture(scope="module")
def env():
    job = load_job(EX + "grpo-7b.yaml")
    cluster = load_cluster(EX + "cluster-h100-4n.yaml")
    return SimpleNamespace(job=job, cluster=cluster, w=job.workload(), gt=ModelWorld(job, cluster, seed=1),
                           plans=PlanCache(job, cluster, time_limit_s=10, seed=0))


def observed(env, step: int, plan, gpus: int = 32, **kw) -> StepMetrics:
    """What a training loop would report after running ``plan`` for one step of the scenario's workload."""
    obs = env.gt.observe(plan, env.w, step)
    return StepMetrics(step=step, response_len_mean=env.w.response_len_mean, response_len_max=env.w.response_len_max,
                       stage_times=dict(obs.stage_s), gpus_available=gpus, oom=not obs.feasible, **kw)
