"""A switch the executor rolled back reaches the controller (``report_rollback``): it returns to
the plan the job still runs, audits the rollback, and does not retry a switch for speed at once.
Same scenario as test_controller_api.py: GRPO-7B starting on 8 of 32 H100s."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nereus.errors import NereusError
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.plan_cache import PlanCache
from nereus.planner.specs import load_cluster, load_job
from nereus.simulator.groundtruth import GroundTruth

EX = "examples/"


@pytest.fixture(scope="module")
def env():
    job = load_job(EX + "grpo-7b.yaml")
    cluster = load_cluster(EX + "cluster-h100-4n.yaml")
    return SimpleNamespace(job=job, cluster=cluster, w=job.workload(), gt=GroundTruth(job, cluster, seed=1),
                           plans=PlanCache(job, cluster, time_limit_s=10, seed=0))


def _metrics(env, step, plan, gpus=32) -> StepMetrics:
    obs = env.gt.observe(plan, env.w, step)
    return StepMetrics(step=step, response_len_mean=env.w.response_len_mean, response_len_max=env.w.response_len_max,
                       stage_times=dict(obs.stage_s), gpus_available=gpus, oom=not obs.feasible)


def test_a_rolled_back_switch_returns_the_controller_to_the_old_plan_and_is_audited(env):
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e-3, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False, min_dwell=3)
    with pytest.raises(NereusError, match="without a switch"):
        ctl.report_rollback("nothing to undo")
    before = ctl.plan
    d = ctl.step(_metrics(env, 0, before))
    assert d.action == "switch" and ctl.plan == d.plan != before, d.reason
    ctl.report_rollback("checksum mismatch on rank 1", step=0)
    assert ctl.plan == before
    rec = ctl.audit.records[-1]
    assert rec["decision"] == "rollback" and rec["step"] == 0 and "checksum mismatch" in rec["reason"]
    assert rec["plan"] != rec["failed_plan"]
    with pytest.raises(NereusError):  # one rollback per switch
        ctl.report_rollback("again")
    # the job still runs the old plan: the next decision starts from it, and a switch made for
    # speed waits out the dwell from the failed one instead of retrying at once
    d1 = ctl.step(_metrics(env, 1, before))
    assert ctl.audit.records[-1]["decision"] == d1.action == "stay" and not d1.must
    assert "within 3 steps of the last switch" in d1.reason and ctl.plan == before
